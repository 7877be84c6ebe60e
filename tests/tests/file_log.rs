//! `Durability::Logged`: a PUT is acknowledged once the commit log holds it durably, and its
//! block file may still be only in the page cache. So a power loss can take block files away or
//! leave them torn; the next open writes them again from the log. Here a child process commits,
//! overwrites and invalidates blocks and is killed with SIGKILL; the parent then plays the power
//! loss (it removes or cuts every block file the log still covers) and reopens: every
//! acknowledged block is back with its exact bytes, at its newest version (a key is written
//! again after an invalidation), and no invalidated one returns.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, Invalidate, MissReason, Put, Store};
use gpucache_dataplane::testing::fixture::caller;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, LOG_DIR, LOG_SEGMENT_BYTES_MIN};

const CHILD_ENV: &str = "GPUCACHE_LOG_CHILD";
const SPACE: u8 = 0xD1;
const KEYS: u16 = 40;

fn key_of(i: u16) -> PhysicalKey {
    common::block_key(SPACE, 0, i)
}

/// The bytes of version `v` of key `i`: mostly small, one of 5 MiB (above what the log takes,
/// so it is flushed on its own).
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

/// Files in the store's commit-log directory.
fn segments(root: &Path) -> usize {
    std::fs::read_dir(root.join(LOG_DIR)).map_or(0, |d| d.count())
}

#[test]
fn child_entry() {
    let Ok(dir) = std::env::var(CHILD_ENV) else { return };
    let store =
        common::open(common::config(Path::new(&dir), EngineChoice::Psync, Durability::Logged));
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
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nREADY").and_then(|()| out.flush()).expect("stdout");
    // Wait for the kill with the store open (its log not retired).
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
}

#[test]
fn a_power_loss_after_the_acknowledgement_loses_no_logged_block() {
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
            if line == "READY" && tx.send(()).is_err() {
                break;
            }
        }
    });
    let ready = rx.recv_timeout(Duration::from_secs(120));
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("reap");
    assert!(ready.is_ok(), "the child never got ready: {status:?}");
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(segments(&root) > 0, "the killed child left its log");

    // The power loss: every small block file is gone or cut short (the 5 MiB one was flushed
    // on its own before its acknowledgement, so it stays).
    let mut rng = SplitMix64::new(0x5EED);
    let mut lost = 0;
    for path in common::all_block_files(&root) {
        let len = std::fs::metadata(&path).expect("stat").len();
        if len > 4 << 20 {
            continue;
        }
        if rng.chance(0.5) {
            std::fs::remove_file(&path).expect("remove");
        } else {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_len(len / 2))
                .expect("cut");
        }
        lost += 1;
    }
    assert!(lost >= 30, "the power loss took {lost} block files");

    let store = common::open(common::config(&root, EngineChoice::Psync, Durability::None));
    let replayed = store.open_report().log;
    assert!(replayed.recovered >= lost, "{replayed:?}: {lost} files were lost");
    for i in 0..KEYS {
        match fate(i) {
            Some(v) => common::assert_exact(&store, &key_of(i), &payload_of(i, v), "after replay"),
            None => {
                let got = common::get(&store, &key_of(i), 16, 0).0;
                assert_eq!(got, Get::Miss(MissReason::Absent), "key {i} was invalidated");
            }
        }
    }
    assert_eq!(segments(&root), 0, "a replayed log is removed");
    drop(store);
    // Nothing to redo the second time.
    let store = common::open(common::config(&root, EngineChoice::Psync, Durability::Logged));
    assert_eq!(store.open_report().log.segments, 0);
    common::assert_exact(&store, &key_of(1), &payload_of(1, 2), "after a second open");
}

#[test]
fn full_segments_are_retired_and_a_clean_close_leaves_no_log() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let mut config = common::config(&root, EngineChoice::Psync, Durability::Logged);
    config.log_segment_bytes = LOG_SEGMENT_BYTES_MIN;
    let store = common::open(config.clone());
    // About 6 MiB of records through 1 MiB segments.
    for i in 0..150u16 {
        let put = store.put(&caller(0), &key_of(i), &payload_of(i % 5 + 10, 0), None);
        assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
    }
    drop(store);
    assert_eq!(segments(&root), 0, "a closed store leaves no segment");
    let store = common::open(config);
    assert_eq!(store.open_report().log.segments, 0);
    for i in 0..150u16 {
        common::assert_exact(&store, &key_of(i), &payload_of(i % 5 + 10, 0), "after a clean close");
    }
}
