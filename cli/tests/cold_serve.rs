//! `gpucache serve` with an s3 tier below its tiered store, against moto on loopback: blocks the
//! file tier evicts go down to the bucket and come back through the wire byte for byte, the
//! cold tier's metrics say so, and a bucket that cannot be reached stops the start with the
//! key and the reason.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::{KvDtype, TenantId};
use gpucache_dataplane::store::{Get, Put, Store};
use gpucache_dataplane::testing::fixture::{key, payload};

mod common;

use common::{Serve, http_get};

const BLOCK: usize = 64 << 10;
const CREDENTIALS: [(&str, &str); 3] = [
    ("AWS_ACCESS_KEY_ID", "testing"),
    ("AWS_SECRET_ACCESS_KEY", "testing"),
    ("AWS_REGION", "us-east-1"),
];

fn config(dir: &Path, endpoint: &str, bucket: &str) -> std::path::PathBuf {
    let path = dir.join("gpucache.toml");
    std::fs::write(
        &path,
        format!(
            "[store]\nkind = \"tiered\"\nroot = \"{}\"\nengine = \"psync\"\ndurability = \"none\"\n\n\
             [[store.tiers]]\nkind = \"memory\"\ncapacity = \"128KiB\"\n\n\
             [[store.tiers]]\nkind = \"file\"\neviction = \"fifo\"\n\n\
             [[store.tiers]]\nkind = \"s3\"\nendpoint = \"{endpoint}\"\nbucket = \"{bucket}\"\n\
             drain_interval_ms = 20\npack_open_ms = 50\nrequest_timeout_ms = 2000\n\n\
             [limits]\nobject_bytes_max = \"64KiB\"\ntenant_inflight_bytes_max = \"1MiB\"\n\
             retained_bytes_max = \"512KiB\"\ntenant_retained_bytes_max = \"512KiB\"\n\n\
             [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
             [[tenants]]\nname = \"tenant-a\"\nrights = [\"read\", \"write\"]\n",
            dir.join("data").display()
        ),
    )
    .expect("write config");
    path
}

/// The value of the series `name` (labels included) in a scrape.
fn sample(metrics: &str, name: &str) -> Option<u64> {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

#[test]
fn evicted_blocks_go_to_the_bucket_and_come_back_through_the_wire() {
    let Some(moto) = gpucache_cold::moto::start("serve") else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let config = config(dir.path(), &moto.endpoint, "serve");
    let serve = Serve::start_with(Path::new("."), &config, &CREDENTIALS);
    let caller = Caller::new(TenantId::parse("tenant-a").expect("tenant"), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(serve.native(), caller.clone()));
    let block = |i: u8| (key(0, &[3, i], KvDtype::Bf16, 16), payload(u64::from(i) + 500, BLOCK));
    for i in 0..20 {
        let (k, v) = block(i);
        assert!(matches!(client.put(&caller, &k, &v, None).expect("put"), Put::Committed(_)));
    }
    // The file tier holds 8 of the 20; the drain thread carries the other 12 down.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let metrics = http_get(serve.metrics(), "/metrics");
        if sample(&metrics, "gpucache_cold_blocks").is_some_and(|n| n >= 12) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the cold tier never took the evicted blocks:\n{metrics}"
        );
        std::thread::park_timeout(Duration::from_millis(50));
    }
    let mut buf = vec![0u8; BLOCK];
    for i in 0..20 {
        let (k, v) = block(i);
        buf.fill(0);
        let mut got = client.get_into(&caller, &k, &mut buf).expect("get");
        let deadline = Instant::now() + Duration::from_secs(60);
        // A refill moves a block up and so evicts another, which misses until the drain
        // thread has stored it: read again until the deadline.
        let want = Get::Hit { len: BLOCK as u64, checksum: Checksum::of(&v) };
        while got != want {
            assert!(Instant::now() < deadline, "block {i}: {got:?}");
            std::thread::park_timeout(Duration::from_millis(50));
            got = client.get_into(&caller, &k, &mut buf).expect("get");
        }
        assert_eq!(buf, v, "block {i} came back changed");
    }
    let metrics = http_get(serve.metrics(), "/metrics");
    let hits = sample(&metrics, "gpucache_cold_refills_total{outcome=\"hit\",reason=\"\"}");
    assert!(hits.is_some_and(|h| h >= 12), "refill hits: {hits:?}\n{metrics}");
    assert!(
        sample(&metrics, "gpucache_cold_demotions_total{outcome=\"taken\"}")
            .is_some_and(|n| n >= 12)
    );
    assert_eq!(sample(&metrics, "gpucache_cold_degraded"), Some(0));
    serve.stop();
}

#[test]
fn an_unreachable_bucket_stops_the_start_naming_the_tier() {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    // Nothing listens on `port` once the probe socket is dropped.
    let config = config(dir.path(), &format!("http://127.0.0.1:{port}"), "nowhere");
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache"))
        .args(["serve", "--config"])
        .arg(&config)
        .envs(CREDENTIALS)
        .output()
        .expect("run serve");
    assert!(!out.status.success(), "serve started without its bucket");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("store.tiers: the s3 tier (bucket nowhere)"), "{stderr}");
    assert!(!dir.path().join("data").exists(), "a failed start leaves no data directory");
}

fn cold(config: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache"))
        .arg("cold")
        .arg("--config")
        .arg(config)
        .args(args)
        .envs(CREDENTIALS)
        .output()
        .expect("run gpucache cold");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn the_cold_command_reports_retires_and_reclaims_on_the_bucket() {
    let Some(moto) = gpucache_cold::moto::start("ops") else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let config = config(dir.path(), &moto.endpoint, "ops");
    let serve = Serve::start_with(Path::new("."), &config, &CREDENTIALS);
    let caller = Caller::new(TenantId::parse("tenant-a").expect("tenant"), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(serve.native(), caller.clone()));
    for i in 0..16u8 {
        let (k, v) = (key(0, &[4, i], KvDtype::Bf16, 16), payload(u64::from(i), BLOCK));
        assert!(matches!(client.put(&caller, &k, &v, None).expect("put"), Put::Committed(_)));
    }
    // The stop drains what the sink holds.
    serve.stop();
    let (code, text) = cold(&config, &["status"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("blocks=8 "), "the 8 evicted blocks are in the bucket: {text}");
    assert!(text.contains("retired_tenants=0"), "{text}");
    let (code, text) = cold(&config, &["retire", "tenant-a"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("retired tenant=tenant-a"), "{text}");
    let (code, text) = cold(&config, &["reclaim"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("failed=0") && !text.contains("manifests=0 "), "{text}");
    let (code, text) = cold(&config, &["status"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("manifests=0 blocks=0") && text.contains("retired_tenants=1"), "{text}");
    let (code, text) = cold(&config, &["retire", "not a tenant!"]);
    assert_eq!(code, 2, "{text}");
}
