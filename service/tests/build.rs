//! `ValidConfig::build`: a validated configuration becomes a running service in one step (store,
//! native listener with its local socket, RESP, HTTP with readiness), which serves, reports
//! itself in its start lines, and stops; a step that cannot run is refused naming it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::{KvDtype, TenantId};
use gpucache_dataplane::store::{Get, Put, Store};
use gpucache_dataplane::testing::fixture::{key, payload};
use gpucache_service::build::{LOCAL_SOCKET_MODE, StartError};
use gpucache_service::config::ValidConfig;

/// The value of `name=` in a start line.
fn field<'a>(line: &'a str, name: &str) -> &'a str {
    let start = line.find(&format!(" {name}=")).map(|i| i + name.len() + 2);
    let rest = &line[start.unwrap_or_else(|| panic!("no {name}= in {line}"))..];
    rest.split(' ').next().unwrap_or_default()
}

/// One HTTP GET; the endpoint closes every connection after its answer.
fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: gpucache\r\n\r\n").expect("request");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("answer");
    answer
}

#[test]
fn a_valid_config_builds_a_service_that_serves_reports_itself_and_stops() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("data");
    let socket = dir.path().join("s.sock");
    let config = ValidConfig::from_toml_str(&format!(
        "[store]\nroot = \"{}\"\nengine = \"psync\"\n\n\
         [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\
         local = \"{}\"\n\n[[tenants]]\nname = \"tenant-a\"\nrights = [\"read\", \"write\"]\n",
        root.display(),
        socket.display()
    ))
    .expect("valid");
    let service = config.build().expect("build");

    let lines = service.start_lines();
    assert_eq!(lines.len(), 1, "no DPU agent and no staging: one line, {lines:?}");
    let line = &lines[0];
    assert!(line.starts_with("listening native="), "{line}");
    assert_eq!(field(line, "native"), service.native_addr().to_string());
    assert_eq!(field(line, "resp"), service.resp_addr().to_string());
    assert_eq!(field(line, "metrics"), service.metrics_addr().to_string());
    assert_eq!(field(line, "local"), socket.display().to_string());
    assert_eq!(field(line, "root"), root.display().to_string());
    for (name, want) in [
        ("store", "tiered"),
        ("io_engine", "psync"),
        ("io_engine_reason", "\"configured\""),
        ("resp_tenant", "tenant-a"),
        ("sealed_tenants", "0"),
        ("staging", "none"),
    ] {
        assert_eq!(field(line, name), want, "{name} in {line}");
    }
    let mode = std::fs::metadata(&socket).expect("local socket").permissions().mode() & 0o777;
    assert_eq!(mode, LOCAL_SOCKET_MODE, "local socket mode {mode:o}");

    // The store behind the native listener is the configured one, for the configured tenant.
    let caller = Caller::new(TenantId::parse("tenant-a").expect("tenant"), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(service.native_addr(), caller.clone()));
    let k = key(0, &[3, 1], KvDtype::Bf16, 16);
    let data = payload(5, 4096);
    assert!(matches!(client.put(&caller, &k, &data, None).expect("put"), Put::Committed(_)));
    let mut buf = vec![0u8; data.len()];
    assert!(matches!(client.get_into(&caller, &k, &mut buf).expect("get"), Get::Hit { .. }));
    assert_eq!(buf, data);
    let ready = http_get(service.metrics_addr(), "/readyz");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    assert!(ready.contains("ready store=tiered"), "{ready}");
    let metrics = http_get(service.metrics_addr(), "/metrics");
    assert!(metrics.contains("gpucache_limit_retained_bytes"), "limits are registered");

    drop(client);
    let native = service.native_addr();
    assert_eq!(service.stop(), 0, "every connection thread stopped");
    assert!(TcpStream::connect(native).is_err(), "the native listener still accepts");
}

#[test]
fn a_port_in_use_is_refused_naming_its_listener_before_the_store_is_made() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("data");
    let config = ValidConfig::from_toml_str(&format!(
        "[store]\nroot = \"{}\"\n\n[listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:{port}\"\n\
         metrics = \"127.0.0.1:0\"\n",
        root.display()
    ))
    .expect("valid");
    let e = config.build().expect_err("a taken port");
    assert!(matches!(e, StartError::PortInUse { listener: "RESP listener", .. }), "{e:?}");
    let shown = e.to_string();
    assert!(shown.starts_with(&format!("listen: RESP listener 127.0.0.1:{port}: ")), "{shown}");
    assert!(!root.exists(), "the store root was made before the ports were checked");
}
