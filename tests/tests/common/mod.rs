//! Helpers shared by the FileStore integration tests (crash, corruption, faults, restart):
//! seeds, keys and payloads, and readers of the on-disk layout (ADR 0008).

#![allow(dead_code, reason = "each test file uses a different subset of these helpers")]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, Store};
use gpucache_dataplane::testing::fixture;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStore, FileStoreConfig};

/// The seed of a randomized test: `$var` when set (to replay a failure), otherwise fresh. It is
/// printed (libtest shows it when the test fails).
pub(crate) fn seed(var: &str) -> u64 {
    let seed = match std::env::var(var) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("{var}={v} is not a u64")),
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let low = u64::try_from(nanos & u128::from(u64::MAX)).unwrap_or(0);
            SplitMix64::mix(&[low, u64::from(std::process::id())])
        }
    };
    eprintln!("seed: {seed} (replay with {var}={seed})");
    seed
}

/// Deterministic payload bytes for `seed`: the seed's generator stream (8 bytes per step, so
/// large payloads are cheap in debug builds).
pub(crate) fn payload(seed: u64, len: usize) -> Vec<u8> {
    SplitMix64::bytes(seed, len)
}

/// Like [`payload`], with no zero byte: losing any suffix of it changes its content.
pub(crate) fn nonzero_payload(seed: u64, len: usize) -> Vec<u8> {
    let mut p = payload(seed, len);
    for b in &mut p {
        if *b == 0 {
            *b = 0x5A;
        }
    }
    p
}

/// A key of tenant 0 named by `(space, a, b)`; every key from here encodes to the same length.
pub(crate) fn block_key(space: u8, a: u16, b: u16) -> PhysicalKey {
    let [a0, a1] = a.to_be_bytes();
    let [b0, b1] = b.to_be_bytes();
    fixture::key(0, &[space, a0, a1, b0, b1], KvDtype::F16, 16)
}

/// A config for a store under `root` (default limits).
pub(crate) fn config(root: &Path, engine: EngineChoice, durability: Durability) -> FileStoreConfig {
    let mut c = FileStoreConfig::new(root);
    c.engine = engine;
    c.durability = durability;
    // A modest registered arena: these tests open many stores.
    c.engine_config.staging_bytes = 16 << 20;
    c
}

/// Opens a store, panicking with the path on failure.
pub(crate) fn open(c: FileStoreConfig) -> FileStore {
    let root = c.root.clone();
    c.open(Arc::new(ManualClock::default()))
        .unwrap_or_else(|e| panic!("open {}: {e}", root.display()))
}

/// Reads `key` into a fresh buffer of `cap` bytes pre-filled with `fill`.
pub(crate) fn get(store: &dyn Store, key: &PhysicalKey, cap: usize, fill: u8) -> (Get, Vec<u8>) {
    let mut buf = vec![fill; cap];
    let got = store.get_into(&fixture::caller(0), key, &mut buf).expect("get_into");
    (got, buf)
}

/// Asserts `key` reads back exactly `want`.
pub(crate) fn assert_exact(store: &dyn Store, key: &PhysicalKey, want: &[u8], what: &str) {
    let (got, buf) = get(store, key, want.len(), 0xEE);
    match got {
        Get::Hit { len, .. } => {
            assert_eq!(len, want.len() as u64, "{what}: length");
            assert!(buf[..want.len()] == *want, "{what}: bytes differ from the committed payload");
        }
        other => panic!("{what}: expected a hit, got {other:?}"),
    }
}

/// Lower-case hex of a key's digest (the block file name's first part).
pub(crate) fn digest_hex(key: &PhysicalKey) -> String {
    key.digest().0.iter().map(|b| format!("{b:02x}")).collect()
}

/// The block files of `key` under `root/blocks/<xx>/` (at most one for a healthy store).
pub(crate) fn block_files(root: &Path, key: &PhysicalKey) -> Vec<PathBuf> {
    let hex = digest_hex(key);
    let dir = root.join("blocks").join(&hex[..2]);
    let prefix = format!("{hex}-");
    let mut out: Vec<PathBuf> = match fs::read_dir(&dir) {
        Ok(rd) => rd
            .map(|e| e.expect("dir entry").path())
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix))
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    out.sort();
    out
}

/// The one block file of `key`.
pub(crate) fn block_file(root: &Path, key: &PhysicalKey) -> PathBuf {
    let files = block_files(root, key);
    assert_eq!(files.len(), 1, "expected exactly one block file for the key: {files:?}");
    files.into_iter().next().expect("one file")
}

/// `(header_len, payload_len)` from a block file's fixed header (ADR 0008 offsets).
pub(crate) fn header_fields(path: &Path) -> (u64, u64) {
    let bytes = fs::read(path).expect("read block file");
    let header_len = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    let payload_len = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    (u64::from(header_len), payload_len)
}

/// Every file under `root/blocks/*/`.
pub(crate) fn all_block_files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(subs) = fs::read_dir(root.join("blocks")) else { return out };
    for sub in subs {
        let sub = sub.expect("dir entry").path();
        if sub.is_dir() {
            for e in fs::read_dir(&sub).expect("read subdir") {
                out.push(e.expect("dir entry").path());
            }
        }
    }
    out.sort();
    out
}

/// Files in `root/tmp/`.
pub(crate) fn tmp_files(root: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(root.join("tmp"))
        .map(|rd| rd.map(|e| e.expect("dir entry").path()).collect())
        .unwrap_or_default();
    out.sort();
    out
}

/// Sum of the skip counts of an open report.
pub(crate) fn skipped_total(report: &gpucache_storage::file::OpenReport) -> u64 {
    report.skipped.values().sum()
}
