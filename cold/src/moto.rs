//! A moto S3 server on loopback for tests of the cold tier, here and in the crates above
//! (`scripts/setup.sh moto` installs it), started and stopped by PID. Without it a test says
//! so and passes, unless GPUCACHE_REQUIRE_MOTO=1 (CI), where it fails.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{S3Config, S3Objects};

/// A running moto server, killed when dropped.
#[derive(Debug)]
pub struct Moto {
    pub child: Child,
    pub endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The moto server binary: `GPUCACHE_MOTO_VENV`'s, else the workspace's `target/moto-venv`.
pub fn moto_server() -> Option<PathBuf> {
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
pub fn start(bucket: &str) -> Option<Moto> {
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

/// `bucket` on `moto`, with moto's test credentials.
pub fn open(moto: &Moto, bucket: &str) -> S3Objects {
    let mut config = S3Config::new(bucket);
    config.endpoint = Some(moto.endpoint.clone());
    config.access_key_id = Some("testing".into());
    config.secret_access_key = Some("testing".into());
    S3Objects::open(&config).expect("open the bucket")
}

impl Moto {
    /// Kills the server: every call after this fails as a connection error.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
