//! The object store layer against a real S3 server on loopback: moto (`scripts/setup.sh moto`),
//! started and stopped by PID here. Without it these tests say so and pass, unless
//! GPUCACHE_REQUIRE_MOTO=1 (CI), where they fail.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpucache_cold::{
    ColdError, ColdObjects, FaultKind, FaultPlan, FaultyObjects, S3Config, S3Objects,
};

struct Moto {
    child: Child,
    endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn moto_server() -> Option<PathBuf> {
    let venv = std::env::var_os("GPUCACHE_MOTO_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/moto-venv"));
    let server = venv.join("bin/moto_server");
    if server.exists() {
        return Some(server);
    }
    assert!(
        std::env::var("GPUCACHE_REQUIRE_MOTO").as_deref() != Ok("1"),
        "GPUCACHE_REQUIRE_MOTO=1 but {} is missing (scripts/setup.sh moto)",
        server.display()
    );
    eprintln!("skipped: no moto at {} (scripts/setup.sh moto)", server.display());
    None
}

/// One plain HTTP request; the status code of its answer.
fn http(port: u16, request: &str) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(request.as_bytes()).ok()?;
    let mut answer = [0u8; 64];
    let n = s.read(&mut answer).ok()?;
    std::str::from_utf8(&answer[..n]).ok()?.split_whitespace().nth(1)?.parse().ok()
}

/// A moto server on a free loopback port with `bucket` made.
fn start(bucket: &str) -> Option<Moto> {
    let server = moto_server()?;
    let port = TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
    let child = Command::new(server)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn moto_server");
    let moto = Moto { child, endpoint: format!("http://127.0.0.1:{port}") };
    let make = format!(
        "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let start = Instant::now();
    loop {
        if http(port, &make) == Some(200) {
            return Some(moto);
        }
        assert!(start.elapsed() < Duration::from_secs(60), "moto_server did not answer");
        std::thread::park_timeout(Duration::from_millis(50));
    }
}

fn open(moto: &Moto, bucket: &str) -> S3Objects {
    let mut config = S3Config::new(bucket);
    config.endpoint = Some(moto.endpoint.clone());
    config.access_key_id = Some("testing".into());
    config.secret_access_key = Some("testing".into());
    S3Objects::open(&config).expect("open the bucket")
}

#[test]
fn create_only_put_head_ranges_and_delete_against_a_real_s3_server() {
    let Some(moto) = start("cold") else { return };
    let s3 = open(&moto, "cold");
    let bytes: Vec<u8> = (0..100_000u32).map(|i| u8::try_from(i % 251).expect("a byte")).collect();
    assert_eq!(s3.head("packs/a").expect("head"), None, "absent before");
    s3.put_new("packs/a", &bytes).expect("put");
    assert_eq!(s3.head("packs/a").expect("head"), Some(bytes.len() as u64));
    assert_eq!(
        s3.put_new("packs/a", b"other bytes"),
        Err(ColdError::AlreadyExists { key: "packs/a".into() }),
        "names are create-only"
    );
    assert_eq!(s3.get_range("packs/a", 0..bytes.len() as u64).expect("get"), bytes, "unchanged");
    assert_eq!(s3.get_range("packs/a", 4_096..8_192).expect("range"), bytes[4_096..8_192]);
    assert!(matches!(s3.get_range("packs/none", 0..1), Err(ColdError::NotFound { .. })));
    s3.delete("packs/a").expect("delete");
    assert_eq!(s3.head("packs/a").expect("head"), None, "a head proves the delete");
    s3.delete("packs/a").expect("deleting an absent object succeeds");
}

#[test]
fn a_bucket_that_does_not_exist_is_a_permanent_error() {
    let Some(moto) = start("present") else { return };
    let s3 = open(&moto, "absent");
    let e = s3.put_new("k", b"v").expect_err("no bucket");
    assert!(!e.is_transient(), "{e:?}");
}

#[test]
fn seeded_faults_replay_and_each_kind_does_what_it_says() {
    let Some(moto) = start("faults") else { return };
    let plan =
        FaultPlan { seed: 7, server_errors: 100, timeouts: 100, lost_acks: 150, torn_ranges: 200 };
    let faulty = FaultyObjects::new(open(&moto, "faults"), plan);
    let mut acked = Vec::new();
    let mut lost = Vec::new();
    for i in 0..60u8 {
        let key = format!("k/{i}");
        match faulty.put_new(&key, &[i; 1000]) {
            Ok(()) => acked.push(key),
            Err(e) => {
                assert!(e.is_transient(), "{e:?}");
                if e.to_string().contains("lost acknowledgement") {
                    lost.push(key);
                }
            }
        }
    }
    let store = faulty.inner();
    for key in &acked {
        assert_eq!(store.head(key).expect("head"), Some(1000), "an acknowledged PUT is there");
    }
    assert!(!lost.is_empty(), "the plan lost some acknowledgements");
    for key in &lost {
        assert_eq!(
            store.head(key).expect("head"),
            Some(1000),
            "a lost acknowledgement still wrote"
        );
    }
    let mut torn = 0;
    for key in &acked {
        if let Ok(b) = faulty.get_range(key, 0..1000)
            && b.len() < 1000
        {
            torn += 1;
        }
    }
    assert!(torn > 0, "some ranges came back torn");
    // The same seed over the same calls meets the same faults.
    let again = FaultyObjects::new(open(&moto, "faults"), plan);
    for i in 0..60 {
        let _ = again.put_new(&format!("again/{i}"), &[1u8; 10]);
    }
    let first: Vec<FaultKind> = faulty.faults().into_iter().take(60).collect();
    assert_eq!(again.faults(), first);
}
