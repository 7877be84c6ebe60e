//! `gpucache fsck` finds a damaged payload and a foreign file (exit 1, both named), removes them
//! with `--repair`, and then finds the store clean (exit 0); usage errors exit 2.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::{
    CacheIdentity, Digest32, KvDtype, PositionEncoding, QuantFormat, Shard, TenantId,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{Put, Store};
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};

fn key(n: u8) -> PhysicalKey {
    let id = CacheIdentity::builder()
        .tenant("tenant-fsck")
        .trust_domain("lab")
        .model_revision("m1")
        .model_config(Digest32([4; 32]))
        .tokenizer_revision("t1")
        .kv_dtype(KvDtype::F16)
        .quant(QuantFormat::None)
        .layout("paged", 1)
        .shard(Shard::SOLO)
        .position(PositionEncoding::Alibi)
        .chain(vec![Digest32([n; 32])])
        .block_tokens(16)
        .valid_tokens(16)
        .build()
        .unwrap();
    PhysicalKey::new(id)
}

/// A closed store under `root` with three committed blocks of 10,000 bytes.
fn make_store(root: &Path) {
    let mut config = FileStoreConfig::new(root);
    config.engine = EngineChoice::Psync;
    config.durability = Durability::None;
    let store = config.open(Arc::new(MonotonicClock::default())).unwrap();
    let caller = Caller::new(TenantId::parse("tenant-fsck").unwrap(), Rights::READ_WRITE);
    for n in 1..=3 {
        let payload = vec![n; 10_000];
        assert!(matches!(store.put(&caller, &key(n), &payload, None), Ok(Put::Committed(_))));
    }
}

fn block_files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in fs::read_dir(root.join("blocks")).unwrap() {
        let sub = sub.unwrap().path();
        for f in fs::read_dir(&sub).unwrap() {
            out.push(f.unwrap().path());
        }
    }
    out.sort();
    out
}

/// Adds one to a payload byte of a block file (the header declares its own length).
fn corrupt_payload(path: &Path) {
    let file = OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut len = [0u8; 4];
    file.read_exact_at(&mut len, 8).unwrap();
    let at = u64::from(u32::from_le_bytes(len)) + 123;
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).unwrap();
    byte[0] = byte[0].wrapping_add(1);
    file.write_all_at(&byte, at).unwrap();
}

/// The tests run one at a time: a store's LOCK is an flock, and a child that another test
/// thread forks while a store is open keeps that lock until it execs, which can make fsck of a
/// just-closed store see it as still open.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn fsck(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache")).arg("fsck").args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn finds_repairs_and_then_passes() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    make_store(&root);
    let dir_arg = root.to_str().unwrap();

    let (code, out, err) = fsck(&[dir_arg]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("files:     3") && out.contains("result:    clean"), "{out}");

    let blocks = block_files(&root);
    assert_eq!(blocks.len(), 3);
    let damaged = &blocks[1];
    corrupt_payload(damaged);
    let foreign = blocks[0].parent().unwrap().join("notes.txt");
    fs::write(&foreign, b"not a block").unwrap();

    let (code, out, err) = fsck(&[dir_arg]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("files:     4") && out.contains("bad:       2"), "{out}");
    assert!(out.contains("payload checksum mismatch: 1"), "{out}");
    assert!(out.contains(damaged.to_str().unwrap()), "{out}");
    assert!(out.contains(foreign.to_str().unwrap()), "{out}");
    assert!(out.contains("ok:        2"), "{out}");
    assert!(err.contains("100%  4/4 files"), "progress line on stderr: {err:?}");
    assert!(damaged.exists() && foreign.exists(), "fsck without --repair removes nothing");

    let (code, out, _) = fsck(&[dir_arg, "--repair"]);
    assert_eq!(code, 1, "repair still reports what it found: {out}");
    assert!(out.contains("repaired:  2"), "{out}");
    assert!(!damaged.exists() && !foreign.exists());

    let (code, out, _) = fsck(&[dir_arg]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("files:     2") && out.contains("bad:       0"), "{out}");
}

#[test]
fn usage_and_io_errors_exit_2() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let (code, _, err) = fsck(&[missing.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("not a directory"), "{err}");

    let (code, _, err) = fsck(&[dir.path().to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("not a FileStore directory"), "{err}");

    let (code, _, _) = fsck(&[]);
    assert_eq!(code, 2, "clap reports a missing argument with 2");

    // A store that is open holds its lock; fsck refuses it.
    let root = dir.path().join("open");
    let mut config = FileStoreConfig::new(&root);
    config.engine = EngineChoice::Psync;
    let _store = config.open(Arc::new(MonotonicClock::default())).unwrap();
    let (code, _, err) = fsck(&[root.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("open by a running store"), "{err}");
}
