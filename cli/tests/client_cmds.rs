//! `gpucache put`, `get` and `stat` as a new user meets them: create-only values, a tenant the
//! server does not know, a port that is not the native one, an oversize value, a busy server,
//! how much a small GET asks the server to fill, and what each subcommand's `--help` says.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::testing::fixture::BeforeGet;
use gpucache_dataplane::testing::process::output_within;
use gpucache_service::config::{
    NATIVE_ADDR_DEFAULT, NIXL_SLOT_BYTES_DEFAULT, ServeConfig, StoreKind, TENANT_DEFAULT,
};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;

mod common;

use common::{Serve, gpucache, gpucache_with_input};

/// Well past the client's handshake deadline, well short of its request deadline (30 s).
const FAST_FAILURE: Duration = Duration::from_secs(15);

/// A memory store on loopback ports chosen by the system, one open tenant, `extra` appended.
fn serve(dir: &Path, extra: &str) -> Serve {
    let config = dir.join("gpucache.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nkind = \"memory\"\n\n\
             [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\
             {extra}\n\
             [[tenants]]\nname = \"default\"\nrights = [\"read\", \"write\"]\n"
        ),
    )
    .expect("config");
    Serve::start_in(dir, &config)
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// One RESP request on a fresh connection; the reply's first line.
fn resp_line(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect resp");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s.write_all(request).expect("send");
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    while !reply.ends_with(b"\r\n") {
        match s.read(&mut byte) {
            Ok(1) => reply.push(byte[0]),
            other => panic!("RESP reply ended after {reply:?}: {other:?}"),
        }
    }
    String::from_utf8_lossy(&reply).trim_end().to_owned()
}

#[test]
fn put_of_another_value_is_refused_as_set_refuses_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let running = serve(dir.path(), "");
    let native = running.field("native=").to_owned();
    let resp: SocketAddr = running.field("resp=").parse().expect("resp addr");
    let first = dir.path().join("first");
    std::fs::write(&first, b"the first value").expect("write");
    let out = gpucache_with_input(
        &["put", "layer/7", first.to_str().expect("path"), "--addr", &native],
        None,
    );
    assert!(out.status.success(), "put: {}", stderr(&out));

    // The same bytes again: the name holds what was asked for.
    let out = gpucache_with_input(&["put", "layer/7", "--addr", &native], Some(b"the first value"));
    assert!(out.status.success(), "put of the same value: {}", stderr(&out));
    assert!(stderr(&out).contains("already stored"), "{}", stderr(&out));

    // Other bytes (same length, then another length): refused, and the value is unchanged.
    for other in [&b"the other value"[..], b"longer than the first value"] {
        let out = gpucache_with_input(&["put", "layer/7", "--addr", &native], Some(other));
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "put of another value: {err}");
        let why = err.trim().strip_prefix("gpucache put: ").unwrap_or_else(|| panic!("{err}"));
        assert!(why.contains("different value"), "{why}");
        // The RESP front refuses the same case with the same words.
        let reply = resp_line(resp, b"SET layer/7 another\r\n");
        assert!(reply.starts_with("-ERR ") && reply.contains(why), "RESP: {reply:?}, CLI: {why:?}");
    }
    let out = gpucache_with_input(&["get", "layer/7", "--addr", &native], None);
    assert_eq!(out.stdout, b"the first value");
    running.stop();
}

#[test]
fn an_unknown_tenant_is_named_as_such() {
    let dir = tempfile::tempdir().expect("temp dir");
    let running = serve(dir.path(), "");
    let native = running.field("native=").to_owned();
    for args in [&["get", "x"][..], &["stat"][..], &["put", "x"][..]] {
        let mut argv = args.to_vec();
        argv.extend(["--addr", &native, "--tenant", "nosuch"]);
        let out = gpucache_with_input(&argv, Some(b"v"));
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{argv:?}: {err}");
        assert!(err.contains("unknown tenant \"nosuch\""), "{argv:?}: {err}");
        assert!(!err.contains("hello"), "{argv:?}: {err}");
    }
    running.stop();
}

#[test]
fn stat_against_a_port_that_is_not_gpcw_fails_fast() {
    let dir = tempfile::tempdir().expect("temp dir");
    let running = serve(dir.path(), "");
    for port in ["resp=", "metrics="] {
        let addr = running.field(port).to_owned();
        let started = Instant::now();
        let (code, _, err) = gpucache(&["stat", "--addr", &addr]);
        let took = started.elapsed();
        assert_eq!(code, 1, "stat --addr {addr} ({port}): {err}");
        assert!(took < FAST_FAILURE, "stat --addr {addr} ({port}) took {took:?}: {err}");
        assert!(err.contains("GPCW"), "stat --addr {addr} ({port}): {err}");
    }
    running.stop();
}

#[test]
fn an_oversize_put_is_refused_before_it_is_read() {
    const LIMIT: u64 = 1 << 20;
    let dir = tempfile::tempdir().expect("temp dir");
    let running = serve(dir.path(), &format!("\n[limits]\nobject_bytes_max = {LIMIT}\n"));
    let native = running.field("native=").to_owned();

    // A sparse file of 1 TiB: reading it whole is not an option.
    let huge = dir.path().join("huge");
    std::fs::File::create(&huge).and_then(|f| f.set_len(1 << 40)).expect("sparse file");
    let started = Instant::now();
    let (code, _, err) =
        gpucache(&["put", "huge", huge.to_str().expect("path"), "--addr", &native]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(&LIMIT.to_string()) && err.contains("object limit"), "{err}");
    assert!(started.elapsed() < FAST_FAILURE, "took {:?}", started.elapsed());

    // Standard input: read up to the limit and one byte more, then refused; the rest is never
    // read, so the writer finds the pipe closed.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpucache"))
        .args(["put", "from-stdin", "--addr", &native])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut stdin = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || {
        let chunk = vec![7u8; 1 << 20];
        for _ in 0..256 {
            if let Err(e) = stdin.write_all(&chunk) {
                return Err(e.kind());
            }
        }
        Ok(())
    });
    let out = output_within(child, FAST_FAILURE);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&LIMIT.to_string()) && err.contains("object limit"), "{err}");
    let written = writer.join().expect("writer");
    assert_eq!(written, Err(std::io::ErrorKind::BrokenPipe), "put read all 256 MiB: {err}");

    // At the limit it is stored.
    let fits = dir.path().join("fits");
    std::fs::write(&fits, vec![1u8; 1 << 20]).expect("write");
    let (code, _, err) =
        gpucache(&["put", "fits", fits.to_str().expect("path"), "--addr", &native]);
    assert_eq!(code, 0, "{err}");
    running.stop();
}

/// The server fills (and, past the buffer it reuses, zeroes) as many bytes as a GET asks for:
/// asking for the largest value to read a small one made every small `get` tens of milliseconds
/// slower than `put`. `get` asks for exactly the looked-up length.
#[test]
fn a_small_get_asks_for_exactly_the_value_and_not_the_largest_one() {
    // The destination size of every GET the server serves.
    let get_buffers = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::clone(&get_buffers);
    let memory = MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default()))
        .expect("limits");
    let store = BeforeGet::new(memory, move |dst: &[u8]| {
        recorded.lock().expect("lock").push(dst.len());
    });
    let tenant = Caller::new(TenantId::parse("default").expect("tenant"), Rights::READ_WRITE);
    let config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), vec![tenant]);
    let server = Server::start(config, Arc::new(store)).expect("server");
    let native = server.local_addr().to_string();
    let value = b"a small value";
    let out = gpucache_with_input(&["put", "small", "--addr", &native], Some(value));
    assert!(out.status.success(), "put: {}", stderr(&out));
    let out = gpucache_with_input(&["get", "small", "--addr", &native], None);
    assert!(out.status.success(), "get: {}", stderr(&out));
    assert_eq!(out.stdout, value);
    assert_eq!(*get_buffers.lock().expect("lock"), vec![value.len()]);
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn a_busy_server_is_reported_with_its_counts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let running = serve(dir.path(), "connections_max = 1\n");
    let native: SocketAddr = running.native();
    // This connection is the one the server allows (its session is open, so it was accepted).
    let caller = Caller::new(TenantId::parse("default").expect("tenant"), Rights::READ_ONLY);
    let holder = TcpStore::new(ClientConfig::new(native, caller.clone()));
    holder.handshake(&caller).expect("the first connection is served");
    for args in [&["get", "x"][..], &["stat"][..]] {
        let mut argv = args.to_vec();
        let addr = native.to_string();
        argv.extend(["--addr", &addr]);
        let (code, _, err) = gpucache(&argv);
        assert_eq!(code, 1, "{argv:?}: {err}");
        assert!(err.contains("busy (1 of 1 connections)"), "{argv:?}: {err}");
    }
    drop(holder);
    running.stop();
}

/// The positional arguments of `--help` output's `Arguments:` section, each with its help
/// (on its own line, or on the lines below it, indented further).
fn arguments(help: &str) -> Vec<(String, String)> {
    let mut found: Vec<(String, String)> = Vec::new();
    let section = help.lines().skip_while(|l| l.trim() != "Arguments:").skip(1);
    // The section ends at the next heading (a line that is not indented).
    for line in section.take_while(|l| l.is_empty() || l.starts_with(' ')) {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if indent <= 4 && (trimmed.starts_with('<') || trimmed.starts_with('[')) {
            let (name, text) = trimmed.split_once(char::is_whitespace).unwrap_or((trimmed, ""));
            found.push((name.to_owned(), text.trim().to_owned()));
        } else if let Some((_, text)) = found.last_mut() {
            text.push_str(trimmed);
        }
    }
    found
}

/// The long options `--help` lists.
fn options(help: &str) -> Vec<&str> {
    help.lines()
        .filter_map(|l| l.trim_start().split(' ').find(|w| w.starts_with("--")))
        .map(|w| w.trim_end_matches(','))
        .collect()
}

#[test]
fn help_names_listeners_arguments_and_only_the_options_that_apply() {
    let help = |args: &[&str]| {
        let mut argv = args.to_vec();
        argv.push("--help");
        let (code, out, err) = gpucache(&argv);
        assert_eq!(code, 0, "{argv:?}: {err}");
        out
    };
    let serve = help(&["serve"]);
    // What the help says of the embedded default is what the embedded default is.
    let d = ServeConfig::default().validate().expect("the embedded default");
    let local = d.local_socket().expect("the embedded default has a local socket");
    let defaults = [
        format!("native   {}", d.listen.native),
        format!("local    {}", local.display()),
        format!("resp     {}", d.listen.resp),
        format!("metrics  {}", d.listen.metrics),
        format!("a FileStore under {}", d.store.root.display()),
        "a tiered store".to_owned(),
    ];
    let words = ["GPCW", "Unix socket", "shared memory", "RESP", "/metrics", "/livez", "/readyz"];
    for shown in defaults.iter().map(String::as_str).chain(words).chain(["/healthz"]) {
        assert!(serve.contains(shown), "serve --help does not say {shown:?}:\n{serve}");
    }
    assert_eq!(d.store.kind, StoreKind::Tiered, "serve --help calls the default a tiered store");

    let subcommands: &[&[&str]] =
        &[&["key"], &["fsck"], &["serve"], &["dpu-agent"], &["put"], &["get"], &["stat"]];
    for args in subcommands {
        let text = help(args);
        for (name, said) in arguments(&text) {
            assert!(!said.is_empty(), "{args:?}: argument {name} has no help:\n{text}");
        }
    }
    // The harnesses are gpucache-bench's, not the operators' binary's.
    let bench_help = |args: &[&str]| {
        let mut argv = args.to_vec();
        argv.push("--help");
        let (code, out, err) = common::gpucache_bench(&argv);
        assert_eq!(code, 0, "gpucache-bench {argv:?}: {err}");
        out
    };
    let harnesses = ["file", "dpu", "service", "nixl", "python", "trace", "cold"];
    let listed = bench_help(&[]);
    for harness in harnesses {
        assert!(listed.contains(&format!("  {harness} ")), "gpucache-bench lacks {harness}");
        let text = bench_help(&[harness]);
        for (name, said) in arguments(&text) {
            assert!(!said.is_empty(), "{harness}: argument {name} has no help:\n{text}");
        }
    }
    assert!(!help(&[]).contains("  bench "), "gpucache still lists bench:\n{}", help(&[]));
    let (code, _, err) = gpucache(&["bench", "file", "--help"]);
    assert_eq!(code, 2, "gpucache bench is gone: {err}");
    assert_eq!(arguments(&help(&["put"])).len(), 2, "put takes NAME and FILE");

    let stat_help = help(&["stat"]);
    let stat = options(&stat_help);
    for common in ["--addr", "--tenant", "--deadline-s", "--secret-file", "--key-id", "--seal"] {
        assert!(stat.contains(&common), "stat --help lacks {common}: {stat:?}");
    }
    for absent in ["--shm-segment", "--huge-pages", "--nixl", "--nixl-slot-bytes"] {
        assert!(!stat.contains(&absent), "stat --help lists {absent}: {stat:?}");
    }
    let put_help = help(&["put"]);
    let put = options(&put_help);
    assert!(put.contains(&"--shm-segment") && put.contains(&"--nixl"), "{put:?}");
    assert!(!put.contains(&"--nixl-slot-bytes"), "put --help lists a get-only option: {put:?}");
    let get_help = help(&["get"]);
    let get = options(&get_help);
    assert!(get.contains(&"--nixl-slot-bytes") && get.contains(&"--shm"), "{get:?}");
    // The client commands' defaults are the service's: its native address, its tenant, its
    // NIXL slot size.
    for (text, shown) in [
        (&stat_help, format!("[default: {NATIVE_ADDR_DEFAULT}]")),
        (&stat_help, format!("[default: {TENANT_DEFAULT}]")),
        (&get_help, format!("[default: {NIXL_SLOT_BYTES_DEFAULT}]")),
    ] {
        assert!(text.contains(&shown), "--help lacks {shown}:\n{text}");
    }
    let d = ServeConfig::default();
    assert_eq!(
        (d.listen.native, d.nixl.slot_bytes),
        (NATIVE_ADDR_DEFAULT, NIXL_SLOT_BYTES_DEFAULT)
    );
    assert_eq!(d.tenants[0].name, TENANT_DEFAULT);
}

/// The binary stays thin (arguments, the client commands, `fsck`, then one call into the
/// service or a harness): its sources stay under 2,000 lines.
#[test]
fn the_binary_stays_thin() {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
    let mut lines = 0;
    let mut files = 0;
    let mut dirs = vec![std::path::PathBuf::from(src)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("cli/src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                lines += std::fs::read_to_string(&path).expect("source").lines().count();
                files += 1;
            }
        }
    }
    assert!(files >= 3, "cli/src has main.rs, client_cmd.rs and fsck.rs; found {files} files");
    assert!(lines < 2_000, "cli/src has {lines} lines; what is not arguments belongs below it");
}
