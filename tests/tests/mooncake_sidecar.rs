//! MooncakeStore and its real sidecar against a fake `mooncake.store` module, so the protocol,
//! the deadlines and the code mapping run without the Mooncake wheel (only `python3`).
//!
//! Each test builds its own fake venv whose `bin/python` runs the system `python3` with a fake
//! `MooncakeDistributedStore` on its path; the fake's behaviour comes from a mode file in that
//! venv. Skipped (with a printed reason) when `python3` is missing.

use std::fs;
use std::io;
use std::num::NonZeroUsize;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::store::{
    Get, Invalidate, Lookup, MissReason, Put, Retirement, Store, StoreError,
};
use gpucache_dataplane::testing::fixture;
use gpucache_mooncake::{
    MooncakeConfig, MooncakeError, MooncakeStore, MooncakeVenv, SidecarConfig,
};

/// A dict-backed stand-in for `MooncakeDistributedStore`, with the codes a live 0.3.13 gave.
const FAKE_STORE: &str = r#"
import ctypes, os, time
MODE = open(os.path.join(os.path.dirname(__file__), "mode")).read().strip()
CAPACITY = 3

class MooncakeDistributedStore:
    def __init__(self):
        self.objects = {}
    def setup(self, *args):
        return -1 if MODE == "setupfail" else 0
    def register_buffer(self, ptr, size):
        return 0
    def put_from(self, key, ptr, size):
        if MODE == "raise":
            raise RuntimeError("transfer failed")
        if MODE == "put-800":
            return -800
        if key in self.objects:
            return 0
        if len(self.objects) >= CAPACITY:
            return -200
        self.objects[key] = ctypes.string_at(ptr, size)
        return 0
    def get_size(self, key):
        return len(self.objects[key]) if key in self.objects else -704
    def get_into(self, key, ptr, size):
        if key not in self.objects:
            return -704
        data = self.objects[key]
        if MODE == "exit":
            os._exit(3)
        if MODE == "hang":
            time.sleep(30)
        if MODE == "short":
            data = data[:-1]
        ctypes.memmove(ptr, data, len(data))
        return len(data) + 1 if MODE == "long" else len(data)
    def is_exist(self, key):
        return 1 if key in self.objects else 0
    def remove(self, key, force=False):
        return 0 if self.objects.pop(key, None) is not None else -704
"#;

fn fake_venv(dir: &Path, mode: &str) -> Option<MooncakeVenv> {
    let python3 =
        Command::new("python3").arg("-c").arg("import sys; print(sys.executable)").output();
    let Some(out) = python3.ok().filter(|o| o.status.success()) else {
        eprintln!("skipping the sidecar tests: python3 is not available");
        return None;
    };
    let python3 = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let site = dir.join("lib/python3/site-packages");
    fs::create_dir_all(site.join("mooncake")).expect("site-packages");
    fs::create_dir_all(dir.join("bin")).expect("bin");
    fs::write(site.join("mooncake/__init__.py"), "").expect("package");
    fs::write(site.join("mooncake/store.py"), FAKE_STORE).expect("fake store");
    fs::write(site.join("mooncake/mode"), mode).expect("mode");
    let script = format!("#!/bin/sh\nPYTHONPATH='{}' exec '{python3}' \"$@\"\n", site.display());
    let python = dir.join("bin/python");
    fs::write(&python, script).expect("python");
    fs::set_permissions(&python, fs::Permissions::from_mode(0o755)).expect("chmod");
    for b in MooncakeVenv::BINARIES {
        fs::write(dir.join("bin").join(b), "").expect("binary stand-in");
    }
    Some(MooncakeVenv::at(dir).expect("the fake venv passes the checks"))
}

fn build(venv: MooncakeVenv, call_ms: u64) -> Result<MooncakeStore, MooncakeError> {
    MooncakeConfig {
        sidecar: SidecarConfig {
            venv,
            metadata_url: "http://127.0.0.1:1/metadata".into(),
            master: "127.0.0.1:1".into(),
            buffer_bytes: NonZeroUsize::new(4096).expect("nonzero"),
            segment_bytes: 0,
            startup_ms: 20_000,
            call_ms,
        },
        reservations_max: NonZeroUsize::new(4).expect("nonzero"),
        namespace: String::new(),
    }
    .build()
}

fn store(mode: &str) -> Option<(tempfile::TempDir, MooncakeStore)> {
    let dir = tempfile::tempdir().expect("dir");
    let venv = fake_venv(dir.path(), mode)?;
    let store = build(venv, 5_000).expect("the sidecar starts");
    Some((dir, store))
}

fn key(n: u8) -> gpucache_dataplane::PhysicalKey {
    fixture::key(0, &[n], KvDtype::Bf16, 16)
}

#[test]
fn round_trip_miss_duplicate_full_and_remove() {
    let Some((_dir, store)) = store("normal") else { return };
    let caller = fixture::caller(0);
    let mut dst = [0_u8; 64];
    assert!(matches!(store.put(&caller, &key(1), b"first", None), Ok(Put::Committed(_))));
    assert_eq!(store.lookup(&caller, &key(1)), Ok(Lookup::Hit { len: 5 }));
    assert!(matches!(store.get_into(&caller, &key(1), &mut dst), Ok(Get::Hit { len: 5, .. })));
    assert_eq!(&dst[..5], b"first");
    assert_eq!(store.get_into(&caller, &key(2), &mut dst), Ok(Get::Miss(MissReason::Absent)));
    assert_eq!(store.put(&caller, &key(1), b"second", None), Ok(Put::AlreadyCommitted));
    assert!(matches!(store.put_unchecked(&caller, &key(1), b"second"), Ok(Put::Committed(_))));
    assert!(matches!(store.get_into(&caller, &key(1), &mut dst), Ok(Get::Hit { len: 5, .. })));
    assert_eq!(&dst[..5], b"first");

    // Reserve, write in pieces, commit.
    let r = store.reserve(&caller, &key(3), 6, None).expect("reserve").into_reservation();
    let r = r.expect("reserved");
    store.write(&caller, &r, 3, b"def").expect("write");
    store.write(&caller, &r, 0, b"abc").expect("write");
    store.commit(&caller, &r).expect("commit");
    assert!(matches!(store.get_into(&caller, &key(3), &mut dst), Ok(Get::Hit { len: 6, .. })));
    assert_eq!(&dst[..6], b"abcdef");

    // The fake holds three objects: the fourth is -200, retired, to re-offer.
    assert!(matches!(store.put(&caller, &key(4), b"x", None), Ok(Put::Committed(_))));
    let e = store.put(&caller, &key(5), b"x", None).expect_err("full");
    assert_eq!(e.retirement(), Retirement::Retired);
    assert!(e.to_string().contains("(-200)"), "{e}");

    assert_eq!(store.invalidate(&caller, &key(1)), Ok(Invalidate::Removed));
    assert_eq!(store.invalidate(&caller, &key(1)), Ok(Invalidate::Absent));
    assert!(matches!(store.put(&caller, &key(5), b"x", None), Ok(Put::Committed(_))));

    // Too small a destination is refused before any transfer.
    let e = store.get_into(&caller, &key(3), &mut dst[..2]).expect_err("too small");
    assert_eq!(e.retirement(), Retirement::Retired);
}

#[test]
fn a_short_read_is_a_retired_failure() {
    let Some((_dir, store)) = store("short") else { return };
    let caller = fixture::caller(0);
    store.put(&caller, &key(1), b"payload", None).expect("put");
    let e = store.get_into(&caller, &key(1), &mut [0_u8; 64]).expect_err("short");
    assert_eq!(e.retirement(), Retirement::Retired, "{e}");
    assert!(e.to_string().contains("short read"), "{e}");
    // A retired failure halts nothing.
    assert!(matches!(store.put(&caller, &key(2), b"more", None), Ok(Put::Committed(_))));
}

#[test]
fn a_long_read_is_unretired_and_halts_payload() {
    let Some((_dir, store)) = store("long") else { return };
    let caller = fixture::caller(0);
    store.put(&caller, &key(1), b"payload", None).expect("put");
    let e = store.get_into(&caller, &key(1), &mut [0_u8; 64]).expect_err("malformed");
    assert_eq!(e.retirement(), Retirement::Unknown, "{e}");
    // The sidecar buffer may be in use: no payload moves again, queries still answer.
    let e = store.put(&caller, &key(2), b"more", None).expect_err("halted");
    assert!(e.to_string().contains("restart required"), "{e}");
    assert_eq!(e.retirement(), Retirement::Retired);
    assert_eq!(store.lookup(&caller, &key(1)), Ok(Lookup::Hit { len: 7 }));
}

#[test]
fn other_negatives_and_exceptions_are_unretired() {
    for mode in ["put-800", "raise"] {
        let Some((_dir, store)) = store(mode) else { return };
        let e = store.put(&fixture::caller(0), &key(1), b"x", None).expect_err(mode);
        assert_eq!(e.retirement(), Retirement::Unknown, "{mode}: {e}");
    }
}

#[test]
fn a_missed_deadline_is_unretired_and_breaks_the_sidecar() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(venv) = fake_venv(dir.path(), "hang") else { return };
    let store = build(venv, 500).expect("starts");
    let caller = fixture::caller(0);
    store.put(&caller, &key(1), b"payload", None).expect("put");
    let started = Instant::now();
    let e = store.get_into(&caller, &key(1), &mut [0_u8; 64]).expect_err("deadline");
    assert!(started.elapsed().as_millis() < 5_000, "the deadline did not hold");
    assert_eq!(e.retirement(), Retirement::Unknown, "{e}");
    assert!(e.to_string().contains("within 500 ms"), "{e}");
    let e = store.lookup(&caller, &key(1)).expect_err("broken");
    assert!(e.to_string().contains("sidecar unusable"), "{e}");
    let pid = store.sidecar_pid();
    drop(store);
    // Killed by PID on drop: the process is gone (reaped), not left sleeping.
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "sidecar {pid} survived the drop");
}

#[test]
fn a_sidecar_that_dies_mid_call_is_an_io_failure_with_the_socket_kind() {
    let Some((_dir, store)) = store("exit") else { return };
    let caller = fixture::caller(0);
    store.put(&caller, &key(1), b"payload", None).expect("put");
    let e = store.get_into(&caller, &key(1), &mut [0_u8; 64]).expect_err("the sidecar exited");
    // The reply never comes: the socket reaches its end mid-call, and whether the GET wrote
    // the buffer is unknown.
    assert!(
        matches!(
            e,
            StoreError::Io {
                operation: "mooncake get",
                kind: io::ErrorKind::UnexpectedEof,
                retirement: Retirement::Unknown,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.is_backend_failure());
    let e = store.lookup(&caller, &key(1)).expect_err("broken");
    assert!(e.to_string().contains("sidecar unusable"), "{e}");
}

#[test]
fn a_failed_setup_is_a_typed_startup_error() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(venv) = fake_venv(dir.path(), "setupfail") else { return };
    let e = build(venv, 1_000).expect_err("setup fails");
    assert!(matches!(e, MooncakeError::Startup { .. }), "{e}");
    assert!(e.to_string().starts_with("Mooncake unavailable: "), "{e}");
    assert!(e.to_string().contains("setup returned -1"), "{e}");
}
