//! `gpucache serve` end to end: it starts from a config, serves the client, answers /healthz,
//! stops cleanly on SIGTERM, and a restart keeps committed blocks under a new epoch while a
//! client of the stopped server gets a transport error, never a stale hit.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::{KvDtype, TenantId};
use gpucache_dataplane::store::{Get, Put, Store};
use gpucache_dataplane::testing::fixture::{key, payload};

mod common;

use common::{Serve, field, gpucache_with_input as gpucache, http_get};

#[test]
fn serve_round_trip_restart_and_stale_client() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("data");
    let config = dir.path().join("gpucache.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nkind = \"file\"\nroot = \"{}\"\nengine = \"psync\"\ndurability = \"per-block\"\n\n\
             [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
             [[tenants]]\nname = \"tenant-a\"\nrights = [\"read\", \"write\"]\n",
            root.display()
        ),
    )
    .expect("write config");

    let first = Serve::start(&config);
    let caller = Caller::new(TenantId::parse("tenant-a").expect("tenant"), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(first.native(), caller.clone()));
    let k = key(0, &[7, 7], KvDtype::Bf16, 16);
    let data = payload(77, 300_000);
    assert!(matches!(client.put(&caller, &k, &data, None).expect("put"), Put::Committed(_)));
    let mut buf = vec![0u8; data.len()];
    assert!(matches!(client.get_into(&caller, &k, &mut buf).expect("get"), Get::Hit { .. }));
    assert_eq!(buf, data);
    let health = http_get(first.metrics(), "/healthz");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let metrics = http_get(first.metrics(), "/metrics");
    assert!(metrics.contains("gpucache_ops_total"), "metrics lack op counters");
    let first_epoch = first.epoch();
    first.stop();

    // The client of the stopped server: a transport error, never a stale hit.
    buf.fill(0);
    match client.get_into(&caller, &k, &mut buf) {
        Err(e) if e.is_backend_failure() => assert!(e.to_string().contains("transport"), "{e}"),
        other => panic!("a stopped server answered {other:?}"),
    }
    assert!(buf.iter().all(|b| *b == 0), "a failed get wrote the destination");

    let second = Serve::start(&config);
    assert!(second.epoch() > first_epoch, "restart did not bump the epoch");
    let client = Arc::new(TcpStore::new(ClientConfig::new(second.native(), caller.clone())));
    assert!(matches!(client.get_into(&caller, &k, &mut buf).expect("get"), Get::Hit { .. }));
    assert_eq!(buf, data, "a committed block changed across the restart");
    second.stop();
}

#[test]
fn serve_refuses_a_bad_config_naming_the_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "[listen]\nnative = \"127.0.0.1:0\"\nnativ = \"x\"\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache"))
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nativ"), "the error does not name the bad key: {err}");
}

#[test]
fn put_get_stat_and_redis_cli_round_trip() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("gpucache.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nkind = \"file\"\nroot = \"{}\"\nengine = \"psync\"\n\n\
             [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
             [[tenants]]\nname = \"default\"\nrights = [\"read\", \"write\"]\n",
            dir.path().join("data").display()
        ),
    )
    .expect("config");
    let running = Serve::start(&config);
    let native = running.field("native=").to_owned();
    let resp: SocketAddr = running.field("resp=").parse().expect("resp addr");

    let value = b"prefix KV bytes \r\n with a CRLF inside".to_vec();
    let out = gpucache(&["put", "layer0/block7", "--addr", &native], Some(&value));
    assert!(out.status.success(), "put: {}", String::from_utf8_lossy(&out.stderr));
    let out = gpucache(&["get", "layer0/block7", "--addr", &native], None);
    assert!(out.status.success(), "get: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout, value);
    let out = gpucache(&["get", "never-stored", "--addr", &native], None);
    assert_eq!(out.status.code(), Some(3), "a miss exits 3");
    let out = gpucache(&["stat", "--addr", &native], None);
    assert!(String::from_utf8_lossy(&out.stderr).contains("committed blocks: 1"), "stat: {out:?}");

    // The same plain name through the Redis protocol.
    let have_redis_cli = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("redis-cli").is_file()));
    if have_redis_cli {
        let out = Command::new("redis-cli")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &resp.port().to_string(),
                "--no-raw",
                "GET",
                "layer0/block7",
            ])
            .output()
            .expect("redis-cli");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("prefix KV bytes"), "redis-cli GET: {text}");
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &resp.port().to_string(), "SET", "from-redis", "hello"])
            .output()
            .expect("redis-cli");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK");
        let out = gpucache(&["get", "from-redis", "--addr", &native], None);
        assert_eq!(out.stdout, b"hello");
    } else {
        assert!(
            std::env::var("GPUCACHE_REQUIRE_REDIS_CLI").ok().as_deref() != Some("1"),
            "redis-cli is required but not installed"
        );
        eprintln!("SKIPPED redis-cli part: redis-cli is not installed");
    }
    running.stop();
}

#[test]
fn the_default_exposes_the_local_socket_and_shm_commands_round_trip() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    // Only the ports differ from the embedded default (which listens on fixed ports): the store
    // and its socket land in ./gpucache-data of the working directory.
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("ports.toml");
    std::fs::write(
        &config,
        "[listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n",
    )
    .expect("config");
    let running = Serve::start_in(dir.path(), &config);
    let line = running.line.clone();
    let socket = dir.path().join("gpucache-data").join("gpucache.sock");
    let shown = std::path::PathBuf::from(field(&line, "local="));
    assert_eq!(
        std::fs::canonicalize(&shown).expect("socket shown"),
        std::fs::canonicalize(&socket).expect("socket made")
    );
    let meta = std::fs::metadata(&socket).expect("socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660, "socket mode");
    let native = field(&line, "native=").to_owned();

    let value = payload(5, 3 << 20);
    let out = gpucache(
        &["put", "shm/block", "--addr", &native, "--shm", "--shm-segment", "8M"],
        Some(&value),
    );
    assert!(out.status.success(), "put --shm: {}", String::from_utf8_lossy(&out.stderr));
    let out = gpucache(&["get", "shm/block", "--addr", &native, "--shm"], None);
    assert!(out.status.success(), "get --shm: {}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout == value, "get --shm returned other bytes");
    // The same value over TCP, and a TCP value over the shared path.
    let out = gpucache(&["get", "shm/block", "--addr", &native], None);
    assert!(out.stdout == value, "get over TCP returned other bytes");
    let out = gpucache(&["put", "tcp/block", "--addr", &native], Some(b"over tcp"));
    assert!(out.status.success());
    let out = gpucache(&["get", "tcp/block", "--addr", &native, "--shm"], None);
    assert_eq!(out.stdout, b"over tcp");
    let out = gpucache(&["get", "never-stored", "--addr", &native, "--shm"], None);
    assert_eq!(out.status.code(), Some(3), "a miss over --shm exits 3");
    // A value larger than the segment cannot take the shared path.
    let out = gpucache(
        &["put", "too/big", "--addr", &native, "--shm", "--shm-segment", "1M"],
        Some(&value),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--shm-segment"), "{out:?}");
    let out = gpucache(&["stat", "--addr", &native, "--shm"], None);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("committed blocks: 2"), "stat --shm: {text}");
    assert!(text.contains("shared segment: 67108864 bytes"), "stat --shm: {text}");
    running.stop();
    assert!(!socket.exists(), "the socket outlived the service");
}

#[test]
fn shm_commands_fail_clearly_when_the_server_has_no_local_socket() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("nolocal.toml");
    std::fs::write(
        &config,
        "[store]\nkind = \"memory\"\n\n[listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\n\
         metrics = \"127.0.0.1:0\"\nlocal = \"\"\n",
    )
    .expect("config");
    let running = Serve::start_in(dir.path(), &config);
    let line = running.line.clone();
    assert_eq!(field(&line, "local="), "none");
    let native = field(&line, "native=").to_owned();
    let out = gpucache(&["put", "x", "--addr", &native], Some(b"tcp works"));
    assert!(out.status.success(), "put: {}", String::from_utf8_lossy(&out.stderr));
    for args in [&["get", "x"][..], &["put", "y"][..]] {
        let mut argv = args.to_vec();
        argv.extend(["--addr", &native, "--shm"]);
        let out = gpucache(&argv, Some(b"v"));
        assert_eq!(out.status.code(), Some(1), "{argv:?}: {out:?}");
        assert!(out.stdout.is_empty());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("offers no local socket"), "{argv:?}: {err}");
    }
    running.stop();
}

/// Without the `nixl` feature, `[nixl] enabled = true` stops `serve` with the typed reason, and
/// `--nixl` on the client commands is refused the same way: never a silent start without it.
#[cfg(not(feature = "nixl"))]
#[test]
fn nixl_enabled_without_the_feature_fails_closed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("gpucache.toml");
    std::fs::write(
        &config,
        "[store]\nkind = \"memory\"\n\n\
         [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
         [nixl]\nenabled = true\n",
    )
    .expect("config");
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache"))
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "serve started without NIXL: {err}");
    assert!(
        err.contains("nixl.enabled: NIXL unavailable: built without the nixl feature"),
        "{err}"
    );
    assert!(!err.contains("listening"), "{err}");
    for args in [&["get", "x", "--nixl"][..], &["put", "x", "--nixl"][..]] {
        let out = gpucache(args, Some(b"value"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("--nixl: NIXL unavailable: built without the nixl feature"), "{err}");
    }
}

/// Writing back, a PUT is acknowledged with no file written: SIGTERM writes the blocks down
/// (the restart finds them), kill -9 loses them (the restart misses them, cleanly).
#[test]
fn a_write_back_tier_writes_down_at_sigterm_and_kill_9_loses_only_unwritten_blocks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("data");
    let config = dir.path().join("gpucache.toml");
    std::fs::write(
        &config,
        format!(
            // A file per block: the test counts the block files written down.
            "[store]\nkind = \"tiered\"\nroot = \"{}\"\nengine = \"psync\"\nlayout = \"files\"\n\
             [[store.tiers]]\nkind = \"memory\"\ncapacity = \"64MiB\"\nwrite = \"back\"\n\n\
             [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
             [[tenants]]\nname = \"tenant-a\"\nrights = [\"read\", \"write\"]\n",
            root.display()
        ),
    )
    .expect("write config");
    let caller = Caller::new(TenantId::parse("tenant-a").expect("tenant"), Rights::READ_WRITE);
    let block = |i: u8| (key(0, &[9, i], KvDtype::Bf16, 16), payload(u64::from(i), 100_000));
    let block_files = || walk(&root.join("blocks"));
    let mut buf = vec![0u8; 100_000];

    let first = Serve::start(&config);
    let client = TcpStore::new(ClientConfig::new(first.native(), caller.clone()));
    for i in 0..3 {
        let (k, v) = block(i);
        assert!(matches!(client.put(&caller, &k, &v, None).expect("put"), Put::Committed(_)));
    }
    assert_eq!(block_files(), 0, "writing back, an acknowledged PUT wrote no block file");
    let metrics = http_get(first.metrics(), "/metrics");
    assert!(metrics.lines().any(|l| l == "gpucache_committed_blocks 3"), "{metrics}");
    first.stop();
    assert_eq!(block_files(), 3, "the stop wrote every block down");

    let second = Serve::start(&config);
    let client = TcpStore::new(ClientConfig::new(second.native(), caller.clone()));
    for i in 0..3 {
        let (k, v) = block(i);
        assert!(matches!(client.get_into(&caller, &k, &mut buf).expect("get"), Get::Hit { .. }));
        assert_eq!(buf, v, "block {i} changed across the restart");
    }
    let (k, v) = block(3);
    assert!(matches!(client.put(&caller, &k, &v, None).expect("put"), Put::Committed(_)));
    second.kill_9();

    let third = Serve::start(&config);
    let client = TcpStore::new(ClientConfig::new(third.native(), caller.clone()));
    assert!(
        matches!(client.get_into(&caller, &k, &mut buf).expect("get"), Get::Miss(_)),
        "a block never written down is a miss after kill -9"
    );
    for i in 0..3 {
        let (k, _) = block(i);
        assert!(matches!(client.get_into(&caller, &k, &mut buf).expect("get"), Get::Hit { .. }));
    }
    third.stop();
}

/// Regular files under `dir`, at any depth.
fn walk(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => walk(&e.path()),
            Ok(t) if t.is_file() => 1,
            _ => 0,
        })
        .sum()
}
