//! What `gpucache serve` says about itself is true: `/readyz` turns 503 naming the disk when the
//! store's file system cannot take a maximum-size PUT and recovers once blocks are invalidated
//! (the gauges on /metrics say the same), turns 503 naming the failed write at the first PUT a
//! data directory the server may no longer write refuses (and stays so while reads succeed,
//! until a write does), the io_uring fallback reaches the log when the kernel
//! refuses io_uring, `--log-format json` writes only JSON lines, and a port already in use is
//! refused naming its listener without leaving a data directory behind.
//!
//! The disk test mounts a small tmpfs and the permission test runs the server as `nobody` (root
//! only); without the permission they skip, saying so, except under `CI=true`, where they must
//! run.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::{KvDtype, TenantId};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::Refusal;
use gpucache_dataplane::store::{Get, Invalidate, Put, Store};
use gpucache_dataplane::testing::fixture::{key, payload};

mod common;

use common::{Serve, http_get, start_line};

const TENANT: &str = "tenant-a";

fn config(dir: &Path, root: &Path, engine: &str, object_bytes_max: &str) -> PathBuf {
    config_with(dir, root, engine, object_bytes_max, "")
}

/// [`config`] with `store` (TOML lines) added to its `[store]` section.
fn config_with(
    dir: &Path,
    root: &Path,
    engine: &str,
    object_bytes_max: &str,
    store: &str,
) -> PathBuf {
    let config = dir.join("gpucache.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nkind = \"file\"\nroot = \"{}\"\nengine = \"{engine}\"\n{store}\n\
             [limits]\nobject_bytes_max = \"{object_bytes_max}\"\n\n\
             [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
             [[tenants]]\nname = \"{TENANT}\"\nrights = [\"read\", \"write\"]\n",
            root.display()
        ),
    )
    .expect("write config");
    config
}

fn caller() -> Caller {
    Caller::new(TenantId::parse(TENANT).expect("tenant"), Rights::READ_WRITE)
}

/// A tmpfs of `size` mounted at `at` for the test's lifetime (lazily unmounted on drop).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Result<Self, String> {
        std::fs::create_dir_all(at).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if out.status.success() {
            Ok(Self(at.to_owned()))
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// The HTTP status code and body of a GET.
fn status_and_body(addr: SocketAddr, path: &str) -> (u16, String) {
    let reply = http_get(addr, path);
    let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("status");
    (status, body.to_owned())
}

/// The value of one unlabelled or labelled sample line of a scrape.
fn sample(metrics: &str, series: &str) -> Option<i64> {
    metrics.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// An 8 MiB tmpfs mounted at `at`, or `None` (the test skips) where no tmpfs can be mounted
/// outside CI; CI must be able to.
fn small_tmpfs(at: &Path) -> Option<Tmpfs> {
    match Tmpfs::mount(at, "8m") {
        Ok(t) => Some(t),
        Err(why) if std::env::var("CI").as_deref() != Ok("true") => {
            eprintln!("skipped: cannot mount a tmpfs here ({why})");
            None
        }
        Err(why) => panic!("CI must be able to mount a tmpfs for this test: {why}"),
    }
}

/// PUTs `value` under keys `[chain, 0]`, `[chain, 1]`, ... until the store refuses one for the
/// disk (at most `max` PUTs); the keys it stored.
fn fill_until_refused(
    client: &TcpStore,
    caller: &Caller,
    value: &[u8],
    chain: u8,
    max: usize,
) -> Vec<PhysicalKey> {
    let mut stored = Vec::new();
    let refusal = loop {
        assert!(stored.len() < max, "an 8 MiB tmpfs took {} blocks", stored.len());
        let n = u8::try_from(stored.len()).expect("small");
        let k = key(0, &[chain, n], KvDtype::Bf16, 16);
        match client.put(caller, &k, value, None).expect("put") {
            Put::Committed(_) => stored.push(k),
            Put::Refused(r) => break r,
            other => panic!("put answered {other:?}"),
        }
    };
    assert!(matches!(refusal, Refusal::DiskFull { .. }), "refused for {refusal:?}");
    stored
}

#[test]
fn readyz_names_the_full_disk_and_recovers_after_invalidations() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mount_at = dir.path().join("small");
    let Some(_tmpfs) = small_tmpfs(&mount_at) else { return };
    let root = mount_at.join("data");
    let serve = Serve::start(&config(dir.path(), &root, "psync", "1MiB"));
    let metrics = serve.metrics();
    let (status, body) = status_and_body(metrics, "/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("ready store=file"), "{body}");
    assert!(body.contains("ok disk_room\n") && body.contains("ok store_io\n"), "{body}");

    // Fill the 8 MiB file system with 1 MiB blocks until the store refuses for the disk.
    let caller = caller();
    let client = TcpStore::new(ClientConfig::new(serve.native(), caller.clone()));
    let value = payload(3, 1 << 20);
    let stored = fill_until_refused(&client, &caller, &value, 1, 16);
    assert!(stored.len() >= 2, "only {} blocks fit", stored.len());

    let (status, body) = status_and_body(metrics, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.starts_with("not ready store=file"), "{body}");
    assert!(body.contains(" failing=disk_room\n"), "{body}");
    assert!(body.contains("fail disk_room: the disk has "), "{body}");
    assert!(body.contains("ok store_io\n"), "a refusal is not an I/O failure: {body}");
    // The alias answers the same; liveness does not depend on readiness.
    assert_eq!(status_and_body(metrics, "/healthz").0, 503);
    assert_eq!(status_and_body(metrics, "/livez"), (200, "alive\n".to_owned()));
    let scrape = http_get(metrics, "/metrics");
    assert_eq!(sample(&scrape, "gpucache_ready"), Some(0), "{scrape}");
    assert_eq!(sample(&scrape, r#"gpucache_ready_check{check="disk_room"}"#), Some(0));
    assert_eq!(sample(&scrape, r#"gpucache_ready_check{check="store_io"}"#), Some(1));

    // Two invalidations free 2 MiB: room for a maximum-size PUT again.
    for k in stored.iter().take(2) {
        assert_eq!(client.invalidate(&caller, k).expect("invalidate"), Invalidate::Removed);
    }
    let (status, body) = status_and_body(metrics, "/readyz");
    assert_eq!(status, 200, "{body}");
    let scrape = http_get(metrics, "/metrics");
    assert_eq!(sample(&scrape, "gpucache_ready"), Some(1), "{scrape}");
    assert_eq!(sample(&scrape, r#"gpucache_ready_check{check="disk_room"}"#), Some(1));
    serve.stop();
}

/// The block log on a full device: the PUT that needs a new segment the device has no room for
/// is refused for the disk (not failed, and not an I/O failure), readiness names the disk, and
/// once invalidations empty segments (which the log then deletes) PUTs commit again.
#[test]
fn a_full_device_refuses_log_puts_for_the_disk_until_invalidations_free_segments() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mount_at = dir.path().join("small");
    let Some(_tmpfs) = small_tmpfs(&mount_at) else { return };
    let root = mount_at.join("data");
    let config = config_with(dir.path(), &root, "psync", "64KiB", "layout = \"log\"\n");
    let serve = Serve::start(&config);
    let metrics = serve.metrics();
    assert_eq!(status_and_body(metrics, "/readyz").0, 200);
    let caller = caller();
    let client = TcpStore::new(ClientConfig::new(serve.native(), caller.clone()));
    let value = payload(4, 60_000);
    let stored = fill_until_refused(&client, &caller, &value, 5, 200);
    assert!(stored.len() >= 10, "only {} blocks fit", stored.len());
    let (status, body) = status_and_body(metrics, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(" failing=disk_room\n"), "{body}");
    assert!(body.contains("ok store_io\n"), "a full device is not an I/O failure: {body}");
    // Every block read back exact: the refusal lost nothing.
    let mut buf = vec![0u8; value.len()];
    for k in &stored {
        assert!(matches!(client.get_into(&caller, k, &mut buf).expect("get"), Get::Hit { .. }));
        assert_eq!(buf, value);
    }

    for k in &stored {
        assert_eq!(client.invalidate(&caller, k).expect("invalidate"), Invalidate::Removed);
    }
    // The log's thread deletes the emptied segments; readiness follows (liveness: polled).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while status_and_body(metrics, "/readyz").0 != 200 {
        assert!(std::time::Instant::now() < deadline, "the emptied segments never went");
        std::thread::yield_now();
    }
    let k = key(0, &[6, 0], KvDtype::Bf16, 16);
    assert!(matches!(client.put(&caller, &k, &value, None).expect("put"), Put::Committed(_)));
    serve.stop();
}

/// The uid and gid of `nobody`.
const NOBODY: u32 = 65_534;

#[test]
fn readyz_names_a_write_the_data_directory_refuses_and_recovers_when_writes_succeed() {
    // SAFETY: geteuid(2) reads the process's effective user id; it cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "CI must run this test as root");
        eprintln!("skipped: running the server as another user needs root");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    };
    let dir = tempfile::tempdir().expect("temp dir");
    mode(dir.path(), 0o755);
    let root = dir.path().join("data");
    std::fs::create_dir(&root).expect("data directory");
    std::os::unix::fs::chown(&root, Some(NOBODY), Some(NOBODY)).expect("chown");
    // A file per block: each PUT creates a file, which the directory's mode then refuses (the
    // block log writes into a segment it holds open, which a directory's mode cannot stop).
    let config = config_with(dir.path(), &root, "psync", "1MiB", "layout = \"files\"\n");
    let serve = Serve::start_as(&config, NOBODY);
    let metrics = serve.metrics();
    let caller = caller();
    let client = TcpStore::new(ClientConfig::new(serve.native(), caller.clone()));
    let put = |n: u8| {
        client.put(&caller, &key(0, &[2, n], KvDtype::Bf16, 16), &payload(n.into(), 5000), None)
    };
    assert!(matches!(put(1), Ok(Put::Committed(_))));
    assert_eq!(status_and_body(metrics, "/readyz").0, 200);

    // The server's user may no longer create files in its store.
    for sub in ["tmp", "blocks"] {
        mode(&root.join(sub), 0o555);
    }
    let refused = put(2).expect_err("a PUT into a directory the server may not write");
    assert!(refused.to_string().contains("Permission denied"), "{refused}");
    let (status, body) = status_and_body(metrics, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("fail store_io: ") && body.contains("writing: Permission denied"),
        "{body}"
    );
    // A read that succeeds does not hide the failed write.
    let mut buf = vec![0u8; 5000];
    let got = client.get_into(&caller, &key(0, &[2, 1], KvDtype::Bf16, 16), &mut buf).expect("get");
    assert!(matches!(got, gpucache_dataplane::store::Get::Hit { .. }), "{got:?}");
    assert_eq!(status_and_body(metrics, "/readyz").0, 503);
    let scrape = http_get(metrics, "/metrics");
    assert_eq!(sample(&scrape, r#"gpucache_ready_check{check="store_io"}"#), Some(0));

    // Writable again: the next PUT succeeds and readiness comes back.
    for sub in ["tmp", "blocks"] {
        mode(&root.join(sub), 0o755);
    }
    assert!(matches!(put(3), Ok(Put::Committed(_))));
    let (status, body) = status_and_body(metrics, "/readyz");
    assert_eq!(status, 200, "{body}");
    serve.stop();
}

/// Runs `f` in the child before exec: a seccomp filter that makes io_uring_setup fail with
/// ENOSYS, as a kernel or container that disables io_uring does.
#[cfg(target_arch = "x86_64")]
fn without_io_uring(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only makes two prctl calls
    // on memory it owns (the filter lives on its stack for the duration of the call).
    unsafe {
        command.pre_exec(|| {
            const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
            let nr = u32::try_from(libc::SYS_io_uring_setup).expect("syscall number");
            let errno = libc::SECCOMP_RET_ERRNO | u32::try_from(libc::ENOSYS).expect("errno");
            let stmt = |code: u32, k: u32| libc::sock_filter {
                code: u16::try_from(code).expect("opcode"),
                jt: 0,
                jf: 0,
                k,
            };
            let jump = |k: u32, jt: u8, jf: u8| libc::sock_filter {
                code: u16::try_from(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K).expect("op"),
                jt,
                jf,
                k,
            };
            let load = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
            let mut program = [
                stmt(load, 4), // seccomp_data.arch
                jump(AUDIT_ARCH_X86_64, 0, 3),
                stmt(load, 0), // seccomp_data.nr
                jump(nr, 0, 1),
                stmt(libc::BPF_RET | libc::BPF_K, errno),
                stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
            ];
            let prog = libc::sock_fprog {
                len: u16::try_from(program.len()).expect("len"),
                filter: program.as_mut_ptr(),
            };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &prog as *const libc::sock_fprog,
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn the_io_uring_fallback_reaches_the_log_and_the_start_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = config(dir.path(), &dir.path().join("data"), "auto", "64MiB");

    // RUST_LOG=warn: the fallback warning is written, the info lines are not.
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpucache"));
    command.args(["serve", "--config"]).arg(&config).env("RUST_LOG", "warn");
    command.stderr(Stdio::piped()).stdout(Stdio::null());
    without_io_uring(&mut command);
    let mut child = command.spawn().expect("spawn serve");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let first = rx.recv_timeout(common::START_PATIENCE).expect("serve wrote no warning");
    let _ = child.kill();
    let _ = child.wait();
    assert!(first.contains("WARN"), "{first}");
    assert!(first.contains("io_uring unavailable; file I/O falls back to pread/pwrite"), "{first}");
    assert!(first.contains("Function not implemented"), "the kernel's reason: {first}");
    let rest: Vec<String> = rx.try_iter().collect();
    assert!(rest.iter().all(|l| !l.contains(" INFO ")), "info lines under RUST_LOG=warn: {rest:?}");

    // The default filter: the start line names the engine actually chosen and why.
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpucache"));
    command.args(["serve", "--config"]).arg(&config);
    command.stderr(Stdio::piped()).stdout(Stdio::null());
    without_io_uring(&mut command);
    let mut child = command.spawn().expect("spawn serve");
    let (line, log) = start_line(child.stderr.take().expect("stderr"));
    let _ = child.kill();
    let _ = child.wait();
    let line = line.unwrap_or_else(|| panic!("no start line:\n{}", log.join("\n")));
    assert_eq!(common::field(&line, "io_engine="), "psync", "{line}");
    assert!(line.contains("io_engine_reason=\"io_uring unavailable: "), "{line}");
    assert!(line.contains(&format!("root={}", dir.path().join("data").display())), "{line}");
    assert_eq!(common::field(&line, "object_bytes_max="), "67108864", "{line}");
}

#[test]
fn json_logs_are_json_lines_start_line_included() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = config(dir.path(), &dir.path().join("data"), "psync", "64MiB");
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpucache"))
        .args(["serve", "--log-format", "json", "--config"])
        .arg(&config)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn serve");
    let (line, log) = start_line(child.stderr.take().expect("stderr"));
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.is_some(), "no start line:\n{}", log.join("\n"));
    assert!(log.len() >= 2, "{log:?}");
    for l in &log {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v.get("level").and_then(|l| l.as_str()).is_some(), "{l}");
        assert!(v.get("timestamp").is_some(), "{l}");
    }
    let start: serde_json::Value = serde_json::from_str(log.last().expect("line")).expect("json");
    let message = start["message"].as_str().expect("message");
    assert!(message.contains("io_engine=psync") && message.contains("store=file"), "{message}");
}

#[test]
fn a_port_in_use_names_its_listener_and_leaves_no_data_directory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    for listener in ["native", "resp", "metrics"] {
        let root = dir.path().join(format!("data-{listener}"));
        let addr = |which: &str| {
            if which == listener { format!("127.0.0.1:{port}") } else { "127.0.0.1:0".to_owned() }
        };
        let config = dir.path().join(format!("{listener}.toml"));
        std::fs::write(
            &config,
            format!(
                "[store]\nkind = \"file\"\nroot = \"{}\"\nengine = \"psync\"\n\n\
                 [listen]\nnative = \"{}\"\nresp = \"{}\"\nmetrics = \"{}\"\n\n\
                 [[tenants]]\nname = \"{TENANT}\"\nrights = [\"read\", \"write\"]\n",
                root.display(),
                addr("native"),
                addr("resp"),
                addr("metrics"),
            ),
        )
        .expect("config");
        let out = Command::new(env!("CARGO_BIN_EXE_gpucache"))
            .args(["serve", "--config"])
            .arg(&config)
            .output()
            .expect("run serve");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{listener}: {err}");
        let name = match listener {
            "native" => "native listener",
            "resp" => "RESP listener",
            _ => "metrics listener",
        };
        assert!(err.contains(&format!("{name} 127.0.0.1:{port}: ")), "{listener}: {err}");
        assert!(err.contains("in use"), "{listener}: {err}");
        assert!(!root.exists(), "{listener}: {} was left behind", root.display());
    }
    drop(taken);
}
