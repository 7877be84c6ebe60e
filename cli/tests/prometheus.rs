//! A real Prometheus scrapes `gpucache serve`'s /metrics. Runs when the `prometheus` binary is
//! installed (scripts/test.sh installs it); `GPUCACHE_REQUIRE_PROMETHEUS=1` makes its absence a
//! failure instead of a skip.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn prometheus_scrapes_the_metrics_endpoint() {
    if !on_path("prometheus") {
        assert!(
            std::env::var("GPUCACHE_REQUIRE_PROMETHEUS").ok().as_deref() != Some("1"),
            "prometheus is required (GPUCACHE_REQUIRE_PROMETHEUS=1) but not installed"
        );
        eprintln!("SKIPPED: prometheus is not installed (scripts/test.sh installs it)");
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("gpucache.toml");
    std::fs::write(
        &config,
        "[store]\nkind = \"memory\"\n\n[listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
         [[tenants]]\nname = \"default\"\nrights = [\"read\", \"write\"]\n",
    )
    .expect("config");
    let mut serve = Command::new(env!("CARGO_BIN_EXE_gpucache"))
        .args(["serve", "--config"])
        .arg(&config)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let (line, log) = common::start_line(serve.stderr.take().expect("stderr"));
    let serve = Killed(serve);
    let line = line.unwrap_or_else(|| panic!("serve did not start:\n{}", log.join("\n")));
    let metrics: SocketAddr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("metrics="))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no metrics address in {line:?}"));

    let port = free_port();
    let prom_config = dir.path().join("prometheus.yml");
    std::fs::write(
        &prom_config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: gpucache\n    static_configs:\n      - targets: ['{metrics}']\n"
        ),
    )
    .expect("prometheus config");
    let prometheus = Command::new("prometheus")
        .arg(format!("--config.file={}", prom_config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn prometheus");
    let _prometheus = Killed(prometheus);
    let api: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = http_get(api, "/api/v1/query?query=up%7Bjob%3D%22gpucache%22%7D");
        let scraped = http_get(api, "/api/v1/query?query=gpucache_build_info");
        if let (Some(up), Some(info)) = (&answer, &scraped)
            && up.contains("\"value\":[")
            && up.contains("\"1\"]")
            && info.contains("gpucache_build_info")
        {
            break;
        }
        assert!(Instant::now() < deadline, "prometheus never scraped gpucache: {answer:?}");
        std::thread::park_timeout(Duration::from_millis(200));
    }
    drop(serve);
}
