//! A FileStore whose directory stops taking writes (a device remounted read-only, a permission
//! lost): an invalidation is acknowledged only once the block file is gone durably, otherwise it
//! is a typed `StoreError::Storage` and the block stays readable, also after a restart; a PUT is
//! refused with a typed error and leaves nothing behind. The same holds through RESP `DEL` and
//! the native protocol.
//!
//! The faulty-disk layer fails unlinks and directory syncs on purpose. A real read-only bind
//! mount of the store directory is used too; where mounting is not permitted that test says so
//! and passes, except with `CI=true`, where it fails.

mod common;

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{
    Invalidate, Lookup, MissReason, Put, Retirement, StorageEffect, Store, StoreError,
};
use gpucache_dataplane::testing::fixture::{caller, tenant};
use gpucache_service::resp::{RespConfig, RespServer};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::file::engine::faulty::{FaultConfig, FaultyEngine};
use gpucache_storage::file::engine::psync::PsyncEngine;
use gpucache_storage::file::engine::{EngineChoice, IoEngine};
use gpucache_storage::file::{Durability, FileStore, FileStoreConfig};

use common::{assert_exact, block_file, block_files};

// EROFS and EACCES on Linux (the tests crate has no libc).
const EROFS: i32 = 30;
const EACCES: i32 = 13;
const EIO: i32 = 5;

type Faulty = FaultyEngine<Arc<dyn IoEngine>>;

fn faulty() -> Arc<Faulty> {
    Arc::new(FaultyEngine::new(Arc::new(PsyncEngine) as Arc<dyn IoEngine>, FaultConfig::none(1)))
}

fn open_faulty(root: &Path, engine: &Arc<Faulty>, durability: Durability) -> FileStore {
    let mut c = FileStoreConfig::new(root);
    c.durability = durability;
    FileStore::open_with_engine(
        c,
        Arc::clone(engine) as Arc<dyn IoEngine>,
        Arc::new(ManualClock::default()),
    )
    .expect("open over the faulty engine")
}

fn open_plain(root: &Path) -> FileStore {
    common::open(common::config(root, EngineChoice::Psync, Durability::PerBlock))
}

fn put_ok(store: &dyn Store, key: &PhysicalKey, data: &[u8]) {
    match store.put(&caller(0), key, data, None) {
        Ok(Put::Committed(_)) => {}
        other => panic!("put: {other:?}"),
    }
}

/// Checks that `e` is a storage failure of an invalidation at `step` with `effect` (and `kind`,
/// when given: EIO has no kind of its own to compare with).
fn assert_storage(
    e: &StoreError,
    step: &str,
    kind: Option<io::ErrorKind>,
    effect: StorageEffect,
    what: &str,
) -> PathBuf {
    match e {
        StoreError::Storage {
            operation: "invalidate",
            step: s,
            kind: k,
            effect: f,
            retirement: Retirement::Retired,
            path,
            ..
        } if *s == step && kind.is_none_or(|kind| *k == kind) && *f == effect => path.clone(),
        other => panic!("{what}: expected an invalidate {step} failure ({kind:?}), got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Injected failures

#[test]
fn an_invalidation_that_cannot_unlink_is_refused_and_the_block_survives_a_restart() {
    let cases =
        [(EROFS, io::ErrorKind::ReadOnlyFilesystem), (EACCES, io::ErrorKind::PermissionDenied)];
    for (errno, kind) in cases {
        for durability in [Durability::PerBlock, Durability::GroupCommit, Durability::None] {
            let what = format!("errno {errno}, {durability:?}");
            let dir = tempfile::tempdir().expect("temp dir");
            let root = dir.path();
            let k = common::block_key(1, 0, 0);
            let other = common::block_key(1, 0, 1);
            let data = common::payload(7, 10_000);
            let engine = faulty();
            {
                let store = open_faulty(root, &engine, durability);
                put_ok(&store, &k, &data);
                put_ok(&store, &other, &common::payload(8, 300));
                let file = block_file(root, &k);
                let before = store.stats();
                engine.fail_unlinks(Some(errno));
                for attempt in 0..2 {
                    let e = store.invalidate(&caller(0), &k).expect_err(&what);
                    let path =
                        assert_storage(&e, "unlink", Some(kind), StorageEffect::Unchanged, &what);
                    assert_eq!(path, file, "{what}: the error names the block file");
                    assert!(e.to_string().contains("nothing was changed"), "{what}: {e}");
                    // Still stored, still readable, still counted; a retry is refused the same
                    // way (the failed attempt left no claim on the block behind).
                    assert!(file.exists(), "{what}: attempt {attempt}: the file went");
                    assert_exact(&store, &k, &data, &what);
                    assert_eq!(store.stats(), before, "{what}: attempt {attempt}");
                }
                assert_eq!(engine.counts().unlink_errors, 2, "{what}");
                // Another key is refused the same way; a read-only store still serves reads.
                assert!(store.invalidate(&caller(0), &other).is_err(), "{what}");
                assert_exact(&store, &other, &common::payload(8, 300), &what);
            }
            // A restart finds the block with its bytes.
            let store = open_plain(root);
            assert_exact(&store, &k, &data, &format!("{what}, after a restart"));
            // Once the device takes writes again the invalidation goes through, for good.
            assert_eq!(store.invalidate(&caller(0), &k), Ok(Invalidate::Removed), "{what}");
            assert!(block_files(root, &k).is_empty(), "{what}: the file stayed");
            drop(store);
            let store = open_plain(root);
            assert_eq!(
                store.lookup(&caller(0), &k),
                Ok(Lookup::Miss(MissReason::Absent)),
                "{what}: an acknowledged invalidation came back"
            );
        }
    }
}

#[test]
fn a_removal_that_cannot_be_made_durable_is_not_acknowledged() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let k = common::block_key(2, 0, 0);
    let engine = faulty();
    let store = open_faulty(root, &engine, Durability::PerBlock);
    put_ok(&store, &k, &common::payload(3, 5000));
    let file = block_file(root, &k);
    engine.fail_dir_syncs(Some(EIO));
    let e = store.invalidate(&caller(0), &k).expect_err("a failed directory sync");
    let dir_path =
        assert_storage(&e, "directory sync", None, StorageEffect::NotDurable, "directory sync");
    assert_eq!(Some(dir_path.as_path()), file.parent(), "the error names the directory");
    assert!(e.to_string().contains("not durable"), "{e}");
    // The name is gone, so the block is too: a miss, never a read of a file that is not there.
    assert!(!file.exists());
    assert_eq!(store.lookup(&caller(0), &k), Ok(Lookup::Miss(MissReason::Absent)));
    assert_eq!(store.stats().committed_blocks, 0);
    assert_eq!(store.stats().corrupt_dropped.total(), 0, "a removal is not damage");
    assert_eq!(store.invalidate(&caller(0), &k), Ok(Invalidate::Absent));
    drop(store);
    let store = open_plain(root);
    assert_eq!(store.lookup(&caller(0), &k), Ok(Lookup::Miss(MissReason::Absent)));
}

// ---------------------------------------------------------------------------------------------
// A real read-only mount

/// The store directory bind-mounted over itself and remounted read-only; unmounted on drop.
/// Bind mounts are per mount point, so the store's descriptors opened before (its lock file)
/// stay writable while every path lookup under the directory meets a read-only mount.
struct ReadOnlyMount {
    path: PathBuf,
}

impl ReadOnlyMount {
    fn new(path: &Path) -> Result<Self, String> {
        run_mount(&["--bind", path_str(path), path_str(path)])?;
        let mount = Self { path: path.to_owned() };
        run_mount(&["-o", "remount,bind,ro", path_str(path)])?;
        Ok(mount)
    }
}

impl Drop for ReadOnlyMount {
    fn drop(&mut self) {
        let p = path_str(&self.path);
        let unmounted = Command::new("umount").arg(p).status().is_ok_and(|s| s.success());
        if !unmounted {
            // Detach it at least, so the temporary directory can go.
            let _ = Command::new("umount").args(["-l", p]).status();
        }
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temporary paths are UTF-8")
}

fn run_mount(args: &[&str]) -> Result<(), String> {
    let out = Command::new("mount").args(args).output().map_err(|e| format!("mount: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("mount {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// A read-only mount of `path`, or `None` (with a message) where mounting is not permitted
/// outside CI.
fn read_only_mount(path: &Path) -> Option<ReadOnlyMount> {
    match ReadOnlyMount::new(path) {
        Ok(m) => Some(m),
        Err(e) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true requires a read-only mount for this test: {e}")
        }
        Err(e) => {
            eprintln!("skipped: cannot mount a read-only store directory here ({e})");
            None
        }
    }
}

#[test]
fn a_read_only_mount_refuses_invalidations_and_puts_and_keeps_every_block() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let k1 = common::block_key(3, 0, 1);
    let k2 = common::block_key(3, 0, 2);
    let k3 = common::block_key(3, 0, 3);
    let (d1, d2) = (common::payload(31, 70_000), common::payload(32, 1));
    {
        let store = open_plain(&root);
        put_ok(&store, &k1, &d1);
        put_ok(&store, &k2, &d2);
        let files = common::all_block_files(&root);
        let before = store.stats();
        let Some(mount) = read_only_mount(&root) else { return };

        let e = store.invalidate(&caller(0), &k1).expect_err("invalidate on a read-only mount");
        let path = assert_storage(
            &e,
            "unlink",
            Some(io::ErrorKind::ReadOnlyFilesystem),
            StorageEffect::Unchanged,
            "read-only mount",
        );
        assert_eq!(path, block_file(&root, &k1));
        assert_exact(&store, &k1, &d1, "k1 on a read-only mount");

        // A PUT is refused with a typed, retired error and leaves no trace.
        let e = store.put(&caller(0), &k3, &common::payload(33, 9000), None).expect_err("put");
        assert!(
            matches!(
                e,
                StoreError::Storage {
                    operation: "commit",
                    step: "block write",
                    kind: io::ErrorKind::ReadOnlyFilesystem,
                    effect: StorageEffect::Unchanged,
                    ..
                }
            ),
            "a put on a read-only mount: {e:?}"
        );
        assert_eq!(e.retirement(), Retirement::Retired);
        assert!(e.to_string().to_lowercase().contains("read-only"), "{e}");
        assert_eq!(store.lookup(&caller(0), &k3), Ok(Lookup::Miss(MissReason::Absent)));
        assert_eq!(store.stats(), before, "a refused put changed the store");
        assert_eq!(common::all_block_files(&root), files);
        assert!(common::tmp_files(&root).is_empty());
        // Readiness sees the refused write, and reads that still succeed do not hide it.
        assert_exact(&store, &k2, &d2, "k2 read after the refused put");
        let failing = store.condition().io_failure.flatten();
        assert!(
            failing
                .as_deref()
                .is_some_and(|f| f.starts_with("writing:") && f.contains("Read-only")),
            "the store's condition after a refused put: {failing:?}"
        );
        // Writes succeed again once the mount is writable, and the condition clears.
        drop(mount);
        put_ok(&store, &k3, &common::payload(33, 9000));
        assert_eq!(store.condition().io_failure, Some(None), "a successful put clears it");
        assert_eq!(store.invalidate(&caller(0), &k3), Ok(Invalidate::Removed));
        drop(store);
    }
    // After the restart every block is there with its bytes; the refused put is not.
    let store = open_plain(&root);
    assert_exact(&store, &k1, &d1, "k1 after a restart");
    assert_exact(&store, &k2, &d2, "k2 after a restart");
    assert_eq!(store.lookup(&caller(0), &k3), Ok(Lookup::Miss(MissReason::Absent)));
    assert_eq!(store.invalidate(&caller(0), &k1), Ok(Invalidate::Removed));
    drop(store);
    let store = open_plain(&root);
    assert_eq!(store.lookup(&caller(0), &k1), Ok(Lookup::Miss(MissReason::Absent)));
}

#[test]
fn evictions_on_a_read_only_mount_never_bring_back_other_bytes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("store");
    let limits = ResourceLimits {
        object_bytes_max: 10_000,
        retained_bytes_max: 20_000,
        tenant_retained_bytes_max: 20_000,
        ..ResourceLimits::default()
    };
    let open = |root: &Path| {
        let mut c = common::config(root, EngineChoice::Psync, Durability::PerBlock);
        c.limits = limits.clone();
        common::open(c)
    };
    let blocks: Vec<_> = (0..2u16)
        .map(|i| (common::block_key(4, 0, i), common::payload(40 + u64::from(i), 9000)))
        .collect();
    {
        let store = open(&root);
        for (k, d) in &blocks {
            put_ok(&store, k, d);
        }
        let Some(mount) = read_only_mount(&root) else { return };
        // Making room evicts the oldest block; its file cannot go, and the put itself fails.
        let e =
            store.put(&caller(0), &common::block_key(4, 0, 9), &common::payload(49, 9000), None);
        assert!(e.is_err(), "a put on a read-only mount: {e:?}");
        assert_eq!(store.stats().evictions, 1);
        assert_eq!(store.lookup(&caller(0), &blocks[0].0), Ok(Lookup::Miss(MissReason::Absent)));
        assert_exact(&store, &blocks[1].0, &blocks[1].1, "the newer block");
        drop(store);
        drop(mount);
    }
    // The evicted block's file outlived its eviction: at the next open it is either gone or
    // back with its own bytes (ADR 0008), never anything else.
    let store = open(&root);
    for (k, d) in &blocks {
        let (got, buf) = common::get(&store, k, d.len(), 0xEE);
        match got {
            gpucache_dataplane::store::Get::Hit { len, .. } => {
                assert_eq!(&buf[..usize::try_from(len).expect("fits")], &d[..]);
            }
            gpucache_dataplane::store::Get::Miss(MissReason::Absent) => {}
            other => panic!("after a restart: {other:?}"),
        }
    }
    assert_exact(&store, &blocks[1].0, &blocks[1].1, "the newer block after a restart");
}

// ---------------------------------------------------------------------------------------------
// Through the fronts

/// Sends one inline RESP command and reads one reply: a simple line, an error line, an
/// integer, or a bulk string (`None` for nil).
fn resp(reader: &mut BufReader<TcpStream>, command: &str) -> Result<String, String> {
    reader.get_mut().write_all(format!("{command}\r\n").as_bytes()).expect("send");
    let mut line = String::new();
    reader.read_line(&mut line).expect("reply line");
    let line = line.trim_end().to_owned();
    match line.as_bytes().first() {
        Some(b'-') => Err(line[1..].to_owned()),
        Some(b'$') if line == "$-1" => Ok("(nil)".to_owned()),
        Some(b'$') => {
            let n: usize = line[1..].parse().expect("bulk length");
            let mut bulk = vec![0u8; n + 2];
            reader.read_exact(&mut bulk).expect("bulk");
            Ok(String::from_utf8(bulk[..n].to_vec()).expect("utf-8 value"))
        }
        _ => Ok(line),
    }
}

fn resp_client(addr: SocketAddr) -> BufReader<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    BufReader::new(s)
}

fn resp_server(store: Arc<FileStore>) -> RespServer {
    let config = RespConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), caller(0)).expect("config");
    RespServer::start(config, store).expect("start")
}

#[test]
fn resp_del_answers_an_error_and_the_key_survives_a_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let engine = faulty();
    {
        let store = Arc::new(open_faulty(root, &engine, Durability::PerBlock));
        let server = resp_server(Arc::clone(&store));
        let mut c = resp_client(server.local_addr());
        assert_eq!(resp(&mut c, "SET kept value-1"), Ok("+OK".to_owned()));
        engine.fail_unlinks(Some(EROFS));
        let e = resp(&mut c, "DEL kept").expect_err("DEL on a read-only store answers an error");
        assert!(e.starts_with("ERR invalidate failed: unlink of "), "{e}");
        assert!(e.contains("nothing was changed"), "{e}");
        assert_eq!(resp(&mut c, "GET kept"), Ok("value-1".to_owned()));
        assert_eq!(resp(&mut c, "EXISTS kept"), Ok(":1".to_owned()));
        // A DEL of several keys stops at the first error: nothing is claimed as deleted.
        assert!(resp(&mut c, "DEL absent kept").is_err());
        drop(c);
        server.shutdown();
    }
    let store = Arc::new(open_plain(root));
    let server = resp_server(Arc::clone(&store));
    let mut c = resp_client(server.local_addr());
    assert_eq!(
        resp(&mut c, "GET kept"),
        Ok("value-1".to_owned()),
        "the key is gone after a restart"
    );
    assert_eq!(resp(&mut c, "DEL kept"), Ok(":1".to_owned()));
    drop(c);
    server.shutdown();
    drop(store);
    let store = Arc::new(open_plain(root));
    let server = resp_server(Arc::clone(&store));
    let mut c = resp_client(server.local_addr());
    assert_eq!(resp(&mut c, "GET kept"), Ok("(nil)".to_owned()), "a deleted key came back");
    drop(c);
    server.shutdown();
}

#[test]
fn the_native_protocol_carries_the_storage_error_whole() {
    let dir = tempfile::tempdir().expect("temp dir");
    let engine = faulty();
    let store = Arc::new(open_faulty(dir.path(), &engine, Durability::PerBlock));
    let config = ServerConfig::new(
        "127.0.0.1:0".parse().expect("addr"),
        vec![Caller::new(tenant(0), Rights::READ_WRITE)],
    );
    let server = Server::start(config, Arc::clone(&store) as Arc<dyn Store>).expect("server");
    let client = TcpStore::new(ClientConfig::new(server.local_addr(), caller(0)));
    let k = common::block_key(5, 0, 0);
    let data = common::payload(50, 4096);
    put_ok(&client, &k, &data);
    engine.fail_unlinks(Some(EACCES));
    let local = store.invalidate(&caller(0), &k).expect_err("local");
    let remote = client.invalidate(&caller(0), &k).expect_err("remote");
    assert_storage(
        &remote,
        "unlink",
        Some(io::ErrorKind::PermissionDenied),
        StorageEffect::Unchanged,
        "remote",
    );
    assert_eq!(remote, local, "the error crossed the wire changed");
    assert_exact(&client, &k, &data, "over the wire after a refused invalidation");
    engine.fail_unlinks(None);
    assert_eq!(client.invalidate(&caller(0), &k), Ok(Invalidate::Removed));
    drop(client);
    server.shutdown();
}

#[test]
fn a_block_file_that_cannot_be_written_reaches_a_remote_caller_with_its_kind() {
    let dir = tempfile::tempdir().expect("temp dir");
    let engine = Arc::new(FaultyEngine::new(
        Arc::new(PsyncEngine) as Arc<dyn IoEngine>,
        FaultConfig { write_enospc: 1.0, ..FaultConfig::none(2) },
    ));
    let store = Arc::new(open_faulty(dir.path(), &engine, Durability::PerBlock));
    let config = ServerConfig::new(
        "127.0.0.1:0".parse().expect("addr"),
        vec![Caller::new(tenant(0), Rights::READ_WRITE)],
    );
    let server = Server::start(config, Arc::clone(&store) as Arc<dyn Store>).expect("server");
    let client = TcpStore::new(ClientConfig::new(server.local_addr(), caller(0)));
    let k = common::block_key(6, 0, 0);
    let data = common::payload(60, 4096);
    for (e, what) in [
        (store.put(&caller(0), &k, &data, None).expect_err("local put"), "local"),
        (client.put(&caller(0), &k, &data, None).expect_err("remote put"), "remote"),
    ] {
        assert!(
            matches!(
                e,
                StoreError::Storage {
                    operation: "commit",
                    step: "block write",
                    kind: io::ErrorKind::StorageFull,
                    effect: StorageEffect::Unchanged,
                    retirement: Retirement::Retired,
                    ..
                }
            ),
            "{what}: {e:?}"
        );
    }
    assert!(common::tmp_files(dir.path()).is_empty(), "a failed put left a file");
    // The disk has room again: the same put goes through.
    engine.set_enabled(false);
    put_ok(&client, &k, &data);
    assert_exact(&client, &k, &data, "over the wire after the disk had room");
    drop(client);
    server.shutdown();
}
