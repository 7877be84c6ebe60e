//! `Layout::Log`: small blocks live as records in append-only segments. A durable PUT is
//! acknowledged once a flush of the log covers its record, and a removal marks the record in
//! place. Here a child process commits, overwrites and invalidates blocks and is killed with
//! SIGKILL; the parent then plays what a power loss can leave on top of that (a record cut short
//! after the last acknowledged one) and reopens: every acknowledged block is back with its exact
//! bytes, at its newest version, no invalidated one returns, and the cut record is not served.
//! The other tests cover a removal mark the disk lost, damage inside a record, segments deleted
//! once no block lives in them, the index of a clean close, compaction, and kill -9 during
//! compaction and while several threads append at once.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, Invalidate, MissReason, Put, Store};
use gpucache_dataplane::testing::fixture::caller;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::layout::header_len_for;
use gpucache_storage::file::{
    Durability, FileStore, FileStoreConfig, LOG_DIR, LOG_SEGMENT_BYTES_MIN, Layout,
};

const CHILD_ENV: &str = "GPUCACHE_LOG_CHILD";
/// Set in the compaction crash child: `<dir>`.
const CHURN_ENV: &str = "GPUCACHE_LOG_CHURN_CHILD";
/// Keys the compaction crash child writes at most (the parent kills it long before).
const CHURN_KEYS: u16 = 5_000;
const SPACE: u8 = 0xD1;
const KEYS: u16 = 40;
/// Bytes of a record's frame, before the block header.
const FRAME_BYTES: u64 = 32;
const FRAME_LEN: usize = 32;
/// Where the frame's state byte is.
const STATE_AT: u64 = 5;

fn key_of(i: u16) -> PhysicalKey {
    common::block_key(SPACE, 0, i)
}

/// The bytes of version `v` of key `i`: mostly small, one of 5 MiB (above what the log takes,
/// so it gets a file of its own).
fn payload_of(i: u16, v: u16) -> Vec<u8> {
    let len = if i == 7 { 5 << 20 } else { 1 + usize::from(i) * 3_000 + usize::from(v) * 17 };
    common::payload(u64::from(i) << 16 | u64::from(v), len)
}

/// What the child does to key `i`: its last version, or none when it ends invalidated.
fn fate(i: u16) -> Option<u16> {
    match i % 5 {
        0 => None,
        1 => Some(2),
        _ => Some(0),
    }
}

fn log_config(root: &Path, durability: Durability) -> FileStoreConfig {
    let mut config = common::config(root, EngineChoice::Psync, durability);
    config.layout = Layout::Log;
    config.log_segment_bytes = LOG_SEGMENT_BYTES_MIN;
    config
}

/// Segment files in the store's log directory.
fn segments(root: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(root.join(LOG_DIR))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    found.retain(|p| p.extension().is_some_and(|x| x == "log"));
    found.sort();
    found
}

/// Closes `store` as a crash would leave its log: without the index a clean close writes.
fn close_as_a_crash(store: FileStore) {
    let index = store.root().join(LOG_DIR).join("INDEX");
    drop(store);
    std::fs::remove_file(index).expect("a clean close wrote the index");
}

/// Puts `keys`, each key `i` with the bytes of `payload_of(i + offset, 0)`.
fn put_versions(store: &FileStore, keys: std::ops::Range<u16>, offset: u16) {
    for i in keys {
        let put = store.put(&caller(0), &key_of(i), &payload_of(i + offset, 0), None);
        assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
    }
}

/// The segment and frame offset of the record holding `key`'s committed block.
fn record_of(store: &gpucache_storage::file::FileStore, key: &PhysicalKey) -> (PathBuf, u64) {
    let (path, payload_at) = store.block_location(key).expect("a committed block");
    assert!(path.starts_with(store.root().join(LOG_DIR)), "{} is not in the log", path.display());
    (path, payload_at - header_len_for(key.encoded().len()) as u64 - FRAME_BYTES)
}

#[test]
fn child_entry() {
    let Ok(dir) = std::env::var(CHILD_ENV) else { return };
    let store = common::open(log_config(Path::new(&dir), Durability::PerBlock));
    for i in 0..KEYS {
        let versions = fate(i).map_or(1, |v| v + 1);
        for v in 0..versions {
            // A committed key takes a new version once the old one is invalidated.
            if v > 0 {
                assert_eq!(store.invalidate(&caller(0), &key_of(i)), Ok(Invalidate::Removed));
            }
            let put = store.put(&caller(0), &key_of(i), &payload_of(i, v), None);
            assert!(matches!(put, Ok(Put::Committed(_))), "key {i} v{v}: {put:?}");
        }
        if fate(i).is_none() {
            assert_eq!(store.invalidate(&caller(0), &key_of(i)), Ok(Invalidate::Removed));
        }
    }
    // Where the next record would start: after the last key's record.
    let last = key_of(KEYS - 1);
    let (path, payload_at) = store.block_location(&last).expect("last key");
    let end = (payload_at + payload_of(KEYS - 1, 0).len() as u64).div_ceil(8) * 8;
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nREADY {} {end}", path.display()).and_then(|()| out.flush()).expect("stdout");
    // Wait for the kill with the store open.
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
}

#[test]
fn a_kill_and_a_cut_record_lose_no_acknowledged_block_and_serve_no_cut_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let exe = std::env::current_exe().expect("current exe");
    let mut child = Command::new(exe)
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &root)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("READY ") {
                let _ = tx.send(rest.to_owned());
                break;
            }
        }
    });
    let ready = rx.recv_timeout(Duration::from_secs(120));
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("reap");
    let ready = ready.unwrap_or_else(|e| panic!("the child never got ready ({e}): {status:?}"));
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(!segments(&root).is_empty(), "the killed child left its log");
    // Only the 5 MiB block has a file of its own.
    assert_eq!(common::all_block_files(&root).len(), 1, "small blocks live in the log");

    // What a power loss in the middle of the next append leaves: a frame that checks, then a
    // header cut short.
    let (segment, end) = ready.split_once(' ').expect("path and offset");
    let end: u64 = end.parse().expect("offset");
    let file = std::fs::OpenOptions::new().write(true).open(segment).expect("segment");
    let store = common::open(log_config(&root, Durability::PerBlock));
    let (path, record) = record_of(&store, &key_of(1));
    close_as_a_crash(store);
    let mut frame = vec![0u8; FRAME_LEN + 64];
    std::fs::File::open(&path).expect("segment").read_exact_at(&mut frame, record).expect("read");
    frame[FRAME_LEN + 8..].fill(0xAB);
    file.write_all_at(&frame, end).expect("write the cut record");
    drop(file);

    let store = common::open(log_config(&root, Durability::PerBlock));
    let opened = store.open_report().log;
    assert_eq!(opened.torn, 1, "{opened:?}");
    // Older versions and invalidated keys are marked removed (or went with a compacted
    // segment): the live records are the surviving keys but the 5 MiB one, which has a file.
    assert_eq!(opened.blocks, u64::from(KEYS - KEYS / 5 - 1), "{opened:?}");
    for i in 0..KEYS {
        match fate(i) {
            Some(v) => common::assert_exact(&store, &key_of(i), &payload_of(i, v), "after kill"),
            None => {
                let got = common::get(&store, &key_of(i), 16, 0).0;
                assert_eq!(got, Get::Miss(MissReason::Absent), "key {i} was invalidated");
            }
        }
    }
    assert_eq!(store.stats().committed_blocks, u64::from(KEYS - KEYS / 5));
}

#[test]
fn a_removal_mark_the_disk_lost_cannot_bring_an_older_version_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let store = common::open(log_config(&root, Durability::PerBlock));
    let key = key_of(3);
    assert!(matches!(store.put(&caller(0), &key, &payload_of(3, 0), None), Ok(Put::Committed(_))));
    let old = record_of(&store, &key);
    assert_eq!(store.invalidate(&caller(0), &key), Ok(Invalidate::Removed));
    assert!(matches!(store.put(&caller(0), &key, &payload_of(3, 1), None), Ok(Put::Committed(_))));
    close_as_a_crash(store);
    // The old record's mark undone, as if it never reached the disk.
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&old.0).expect("segment");
    let mut state = [0u8];
    file.read_exact_at(&mut state, old.1 + STATE_AT).expect("read");
    assert_ne!(state[0], 0, "the invalidation marked the old record");
    file.write_all_at(&[0], old.1 + STATE_AT).expect("unmark");

    let store = common::open(log_config(&root, Durability::PerBlock));
    assert_eq!(store.open_report().log.blocks, 2, "both versions look live on disk");
    common::assert_exact(&store, &key, &payload_of(3, 1), "the newer version wins");
    assert_eq!(store.stats().committed_blocks, 1);
    close_as_a_crash(store);
    // The open marked the older record again.
    let store = common::open(log_config(&root, Durability::PerBlock));
    assert_eq!(store.open_report().log.blocks, 1, "{:?}", store.open_report().log);
    common::assert_exact(&store, &key, &payload_of(3, 1), "after a second open");
}

#[test]
fn damage_inside_a_record_is_a_counted_miss_never_wrong_bytes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let store = common::open(log_config(&root, Durability::None));
    for i in 0..3 {
        assert!(matches!(
            store.put(&caller(0), &key_of(i), &payload_of(i + 10, 0), None),
            Ok(Put::Committed(_))
        ));
    }
    assert!(store.corrupt_for_test(&key_of(1), 5));
    let (got, _) = common::get(&store, &key_of(1), 64 << 10, 0);
    assert_eq!(got, Get::Miss(MissReason::Corrupt));
    assert_eq!(store.stats().corrupt_dropped.total(), 1);
    assert_eq!(common::get(&store, &key_of(1), 16, 0).0, Get::Miss(MissReason::Absent));
    common::assert_exact(&store, &key_of(0), &payload_of(10, 0), "a neighbour record");
    common::assert_exact(&store, &key_of(2), &payload_of(12, 0), "a neighbour record");
    close_as_a_crash(store);
    // The damaged record was marked removed: the next open does not find it.
    let store = common::open(log_config(&root, Durability::None));
    assert_eq!(store.open_report().log.blocks, 2, "{:?}", store.open_report().log);
}

#[test]
fn segments_go_once_no_block_lives_in_them_and_survive_a_reopen_while_one_does() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let store = common::open(log_config(&root, Durability::PerBlock));
    // About 6 MiB of records through 1 MiB segments.
    let n = 150u16;
    for i in 0..n {
        let put = store.put(&caller(0), &key_of(i), &payload_of(i % 5 + 10, 0), None);
        assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
    }
    let usage = store.log_usage().expect("a log");
    assert!(usage.segments >= 6, "{usage:?}");
    assert_eq!(usage.live_blocks, u64::from(n));
    // Everything but the last block goes: every sealed segment but the last one's is deleted.
    for i in 0..n - 1 {
        assert_eq!(store.invalidate(&caller(0), &key_of(i)), Ok(Invalidate::Removed));
    }
    let usage = store.log_usage().expect("a log");
    assert_eq!(usage.live_blocks, 1, "{usage:?}");
    assert!(usage.segments <= 2, "{usage:?}");
    drop(store);
    // The deletions ran on the log's thread, which the close waited for; the spare segment
    // went with the close.
    assert!(segments(&root).len() <= 2, "{:?}", segments(&root));
    let store = common::open(log_config(&root, Durability::PerBlock));
    assert_eq!(store.open_report().log.blocks, 1);
    common::assert_exact(&store, &key_of(n - 1), &payload_of((n - 1) % 5 + 10, 0), "reopened");
}

#[test]
fn a_clean_close_leaves_an_index_the_next_open_trusts_and_an_older_one_is_ignored() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let index = root.join(LOG_DIR).join("INDEX");
    let store = common::open(log_config(&root, Durability::None));
    put_versions(&store, 0..30, 10);
    for i in 0..5 {
        assert_eq!(store.invalidate(&caller(0), &key_of(i)), Ok(Invalidate::Removed));
    }
    drop(store);
    let kept = std::fs::read(&index).expect("a clean close wrote the index");

    let store = common::open(log_config(&root, Durability::None));
    let opened = store.open_report().log;
    assert!(opened.indexed, "{opened:?}");
    assert_eq!(opened.blocks, 25, "{opened:?}");
    assert!(!index.exists(), "an open removes the index it used");
    for i in 5..30 {
        common::assert_exact(&store, &key_of(i), &payload_of(i + 10, 0), "from the index");
    }
    for i in 0..5 {
        assert_eq!(common::get(&store, &key_of(i), 16, 0).0, Get::Miss(MissReason::Absent));
    }
    // Changed after that open: key 5 goes, key 0 comes back with other bytes.
    assert_eq!(store.invalidate(&caller(0), &key_of(5)), Ok(Invalidate::Removed));
    assert!(matches!(
        store.put(&caller(0), &key_of(0), &payload_of(99, 1), None),
        Ok(Put::Committed(_))
    ));
    close_as_a_crash(store);
    // The index of the earlier close put back: its epoch is older than the store's, so the
    // open reads the records and sees both changes.
    std::fs::write(&index, kept).expect("put the old index back");
    let store = common::open(log_config(&root, Durability::None));
    let opened = store.open_report().log;
    assert!(!opened.indexed, "a stale index was trusted: {opened:?}");
    assert_eq!(opened.blocks, 25, "{opened:?}");
    assert_eq!(common::get(&store, &key_of(5), 16, 0).0, Get::Miss(MissReason::Absent));
    common::assert_exact(&store, &key_of(0), &payload_of(99, 1), "the newer version");
}

/// An index whose checksum fails, or one of the first format version (no key digests, records
/// in no order), is not trusted: the open reads every record and finds every block.
#[test]
fn a_damaged_or_older_format_index_is_ignored_and_the_open_scans() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let index = root.join(LOG_DIR).join("INDEX");
    let store = common::open(log_config(&root, Durability::None));
    put_versions(&store, 0..20, 10);
    close_as_a_crash(store);
    for what in ["a checksum that fails", "format version 1"] {
        // A clean close leaves an index of the store's newest epoch; then it is changed.
        drop(common::open(log_config(&root, Durability::None)));
        let mut bytes = std::fs::read(&index).expect("a clean close wrote the index");
        let body_len = bytes.len() - 8;
        if what == "format version 1" {
            // The first format's magic, under a checksum that matches.
            bytes[..8].copy_from_slice(b"GPCLIDX1");
            let check = Checksum::of(&bytes[..body_len]).0;
            bytes[body_len..].copy_from_slice(&check.to_le_bytes());
        } else {
            bytes[body_len / 2] ^= 0x40;
        }
        std::fs::write(&index, &bytes).expect("put the index back");
        let store = common::open(log_config(&root, Durability::None));
        let opened = store.open_report().log;
        assert!(!opened.indexed, "{what}: trusted: {opened:?}");
        assert_eq!(opened.blocks, 20, "{what}: {opened:?}");
        for i in 0..20 {
            common::assert_exact(&store, &key_of(i), &payload_of(i + 10, 0), what);
        }
        close_as_a_crash(store);
    }
}

#[test]
fn a_small_store_makes_segments_of_a_sixteenth_of_its_capacity() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let mut config = common::config(&root, EngineChoice::Psync, Durability::None);
    config.layout = Layout::Log;
    config.limits.retained_bytes_max = 48 << 20;
    config.limits.tenant_retained_bytes_max = 48 << 20;
    config.limits.object_bytes_max = 8 << 20;
    let store = common::open(config);
    let put = store.put(&caller(0), &key_of(1), &payload_of(1, 0), None);
    assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
    // Closed first: the log's thread may still be zeroing the next segment while it runs (a
    // close waits for it, then removes that unused segment).
    drop(store);
    let sizes: Vec<u64> =
        segments(&root).iter().map(|p| std::fs::metadata(p).expect("segment").len()).collect();
    assert!(!sizes.is_empty() && sizes.iter().all(|&n| n == 3 << 20), "{sizes:?}");
}

#[test]
fn a_mostly_dead_segment_is_compacted_and_its_live_blocks_keep_their_bytes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let store = common::open(log_config(&root, Durability::PerBlock));
    let put = |i: u16| {
        let put = store.put(&caller(0), &key_of(i), &payload_of(i % 5 + 10, 0), None);
        assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
    };
    // About 6 MiB of records through 1 MiB segments; then nine in ten go.
    for i in 0..150u16 {
        put(i);
    }
    for i in (0..150u16).filter(|i| i % 10 != 0) {
        assert_eq!(store.invalidate(&caller(0), &key_of(i)), Ok(Invalidate::Removed));
    }
    let before = store.log_usage().expect("a log");
    assert_eq!(before.compactions, 0, "{before:?}");
    assert!(before.segments >= 6, "{before:?}");
    // Each rotation compacts the emptiest sealed segment.
    for i in 1000..1150u16 {
        put(i);
    }
    let after = store.log_usage().expect("a log");
    assert!(after.compactions >= 3, "{after:?}");
    assert!(after.moved_bytes > 0, "{after:?}");
    assert_eq!(after.live_blocks, 15 + 150, "{after:?}");
    let survivors: Vec<u16> = (0..150u16).filter(|i| i % 10 == 0).chain(1000..1150).collect();
    for &i in &survivors {
        common::assert_exact(&store, &key_of(i), &payload_of(i % 5 + 10, 0), "after compaction");
    }
    close_as_a_crash(store);
    let store = common::open(log_config(&root, Durability::PerBlock));
    assert_eq!(store.open_report().log.blocks, survivors.len() as u64);
    for &i in &survivors {
        common::assert_exact(&store, &key_of(i), &payload_of(i % 5 + 10, 0), "reopened");
    }
}

/// The churn child's payload for key `i`: 20-60 KiB, so that a 1 MiB segment holds dozens.
fn churn_payload(i: u16) -> Vec<u8> {
    common::payload(0xC0DE_0000 | u64::from(i), 20_000 + usize::from(i % 41) * 1_000)
}

/// Whether the churn child keeps key `i` (it invalidates the others three PUTs later).
fn churn_keeps(i: u16) -> bool {
    i.is_multiple_of(10)
}

#[test]
fn churn_child_entry() {
    let Ok(dir) = std::env::var(CHURN_ENV) else { return };
    let store = common::open(log_config(Path::new(&dir), Durability::PerBlock));
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out);
    for i in 0..CHURN_KEYS {
        let put = store.put(&caller(0), &key_of(i), &churn_payload(i), None);
        assert!(matches!(put, Ok(Put::Committed(_))), "key {i}: {put:?}");
        if writeln!(out, "ACK {i}").and_then(|()| out.flush()).is_err() {
            return;
        }
        if let Some(j) = i.checked_sub(3).filter(|&j| !churn_keeps(j)) {
            assert_eq!(store.invalidate(&caller(0), &key_of(j)), Ok(Invalidate::Removed));
            let compactions = store.log_usage().map_or(0, |u| u.compactions);
            if writeln!(out, "GONE {j} {compactions}").and_then(|()| out.flush()).is_err() {
                return;
            }
        }
    }
}

/// Starts this test binary again to run only the test `entry`, with `env` set to `root`: the
/// child and its standard output.
fn spawn_child(entry: &str, env: &str, root: &Path) -> (Child, ChildStdout) {
    let exe = std::env::current_exe().expect("current exe");
    let mut child = Command::new(exe)
        .args(["--exact", entry, "--nocapture", "--test-threads=1"])
        .env(env, root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {entry}: {e}"));
    let stdout = child.stdout.take().expect("stdout");
    (child, stdout)
}

/// Kill -9 while the log compacts: a child PUTs keys and invalidates nine in ten of them soon
/// after, so that sealed segments fall under half live and each rotation compacts one; the
/// parent kills it after a seeded number of acknowledgements. After the reopen (no index: the
/// child never closed) every acknowledged key not acknowledged gone reads its exact bytes, every
/// key acknowledged gone is absent, and the key whose PUT or invalidation was in flight is
/// either.
#[test]
fn kill_9_during_compaction_loses_no_block_and_brings_none_back() {
    let seed = common::seed("GPUCACHE_LOG_CHURN_SEED");
    let mut rng = SplitMix64::new(seed);
    let mut compacted_rounds = 0;
    for round in 0..6u64 {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("store");
        let kill_after = 150 + rng.below(450);
        let (mut child, stdout) = spawn_child("churn_child_entry", CHURN_ENV, &root);
        let mut acked: Vec<u16> = Vec::new();
        let mut gone: Vec<u16> = Vec::new();
        let mut compactions = 0u64;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(i) = line.strip_prefix("ACK ") {
                acked.push(i.trim().parse().expect("ack"));
            } else if let Some(rest) = line.strip_prefix("GONE ") {
                let (j, n) = rest.split_once(' ').expect("gone line");
                gone.push(j.parse().expect("gone key"));
                compactions = n.trim().parse().expect("compactions");
            }
            // Killed once, then read to the end: what the child printed before it died
            // happened, even when the kill came first.
            if acked.len() as u64 == kill_after {
                child.kill().expect("SIGKILL");
            }
        }
        let status = child.wait().expect("reap");
        assert_eq!(status.signal(), Some(9), "round {round}: {status:?}");
        compacted_rounds += u32::from(compactions > 0);

        let store = common::open(log_config(&root, Durability::PerBlock));
        assert!(!store.open_report().log.indexed, "a killed store left no index");
        let last = *acked.last().expect("acks");
        // The invalidation the child may have been doing when it died.
        let in_flight = last.checked_sub(3).filter(|&j| !churn_keeps(j) && !gone.contains(&j));
        let ctx = format!("seed {seed} round {round} (kill after {kill_after} acks)");
        let mut kept = 0;
        for i in 0..=last + 1 {
            let (got, buf) = common::get(&store, &key_of(i), 64 << 10, 0);
            let want = churn_payload(i);
            let exact = matches!(got, Get::Hit { len, .. } if len == want.len() as u64)
                && buf[..want.len()] == want[..];
            let absent = got == Get::Miss(MissReason::Absent);
            if gone.contains(&i) {
                assert!(absent, "{ctx}: key {i} was acknowledged gone: {got:?}");
            } else if acked.contains(&i) && Some(i) != in_flight {
                assert!(exact, "{ctx}: acknowledged key {i}: {got:?}");
                kept += 1;
            } else {
                assert!(exact || absent, "{ctx}: key {i} in flight: {got:?}");
            }
        }
        assert!(kept > 0, "{ctx}");
        assert_eq!(store.stats().corrupt_dropped.total(), 0, "{ctx}");
    }
    // The seeded kill points land after the first compactions in most rounds.
    assert!(compacted_rounds >= 3, "seed {seed}: compactions ran in {compacted_rounds} rounds");
}

/// Set in the concurrent writers' crash child: `<dir>`.
const WRITERS_ENV: &str = "GPUCACHE_LOG_WRITERS_CHILD";
/// Threads of the concurrent writers' crash child; thread `t` PUTs keys `t`, `t + WRITERS`, ...
const WRITERS: u16 = 4;
/// Keys the concurrent writers' child writes at most (the parent kills it long before).
const WRITERS_KEYS: u16 = 4_000;

/// The concurrent writers' payload for key `i`: one in three of 1-3 MiB (a write long enough for
/// other threads to append and acknowledge records after it meanwhile), the others 1-40 KiB.
fn writers_payload(i: u16) -> Vec<u8> {
    let len = if writers_payload_is_large(i) {
        (1 << 20) + usize::from(i) * 997 % (2 << 20)
    } else {
        1 + usize::from(i) * 7_919 % 40_000
    };
    common::payload(0x3817_0000 | u64::from(i), len)
}

fn writers_payload_is_large(i: u16) -> bool {
    i.is_multiple_of(3)
}

fn writers_config(root: &Path) -> FileStoreConfig {
    let mut config = log_config(root, Durability::None);
    config.log_segment_bytes = 16 << 20;
    config
}

#[test]
fn writers_child_entry() {
    let Ok(dir) = std::env::var(WRITERS_ENV) else { return };
    let store = common::open(writers_config(Path::new(&dir)));
    let out = std::sync::Mutex::new(std::io::stdout());
    let _ = writeln!(out.lock().expect("stdout"));
    std::thread::scope(|s| {
        for t in 0..WRITERS {
            let (store, out) = (&store, &out);
            s.spawn(move || {
                for i in (t..WRITERS_KEYS).step_by(usize::from(WRITERS)) {
                    let put = store.put(&caller(0), &key_of(i), &writers_payload(i), None);
                    assert!(matches!(put, Ok(Put::Committed(_))), "key {i}: {put:?}");
                    let mut out = out.lock().expect("stdout");
                    if writeln!(out, "ACK {i}").and_then(|()| out.flush()).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

/// Kill -9 while several threads append to the log at once, with durability `none` (acknowledged
/// once written). A large record takes a while to write, and the threads behind it reserve later
/// slots of the same segment and finish first; an acknowledgement must not come before every
/// earlier slot of its segment is written, or the open, which ends a segment at its first
/// unwritten record, would drop an acknowledged block. After the reopen every acknowledged key
/// reads its exact bytes and every other key is exact or absent.
#[test]
fn kill_9_with_concurrent_writers_loses_no_acknowledged_block() {
    let seed = common::seed("GPUCACHE_LOG_WRITERS_SEED");
    let mut rng = SplitMix64::new(seed);
    for round in 0..8u64 {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("store");
        let kill_after = 20 + rng.below(120);
        let (mut child, stdout) = spawn_child("writers_child_entry", WRITERS_ENV, &root);
        let mut acked: Vec<u16> = Vec::new();
        // The key each thread PUTs next.
        let mut next: Vec<u16> = (0..WRITERS).collect();
        let mut killed = false;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let Some(i) = line.strip_prefix("ACK ") else { continue };
            let i: u16 = i.trim().parse().expect("ack");
            acked.push(i);
            next[usize::from(i % WRITERS)] = i + WRITERS;
            // Past the seeded count, the kill comes just after a small block is acknowledged
            // while another thread is on a large one: the moment an early acknowledgement
            // would be lost.
            let large_under_way = next.iter().any(|&k| writers_payload_is_large(k));
            if !killed
                && acked.len() as u64 >= kill_after
                && !writers_payload_is_large(i)
                && large_under_way
            {
                child.kill().expect("SIGKILL");
                killed = true;
            }
        }
        let status = child.wait().expect("reap");
        assert_eq!(status.signal(), Some(9), "round {round}: {status:?}");

        let store = common::open(writers_config(&root));
        let ctx = format!("seed {seed} round {round} (kill after {kill_after} acks)");
        let last = acked.iter().copied().max().expect("acks");
        for i in 0..=last + WRITERS {
            let want = writers_payload(i);
            let (got, buf) = common::get(&store, &key_of(i), want.len(), 0);
            let exact =
                matches!(got, Get::Hit { len, .. } if len == want.len() as u64) && buf == want;
            if acked.contains(&i) {
                assert!(exact, "{ctx}: acknowledged key {i}: {got:?}");
            } else {
                assert!(exact || got == Get::Miss(MissReason::Absent), "{ctx}: key {i}: {got:?}");
            }
        }
        assert_eq!(store.stats().corrupt_dropped.total(), 0, "{ctx}");
    }
}
