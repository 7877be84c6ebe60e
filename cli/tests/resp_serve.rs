//! The RESP listener in `gpucache serve`: `listen.resp_tenant` picks (and is checked against) the
//! configured tenants, and a running service answers Redis clients on `listen.resp` as that
//! tenant, next to the native listener, and stops cleanly on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use gpucache_dataplane::caller::Rights;
use gpucache_service::config::{ConfigError, ServeConfig, ValidConfig};

mod common;

use common::{Serve, field};

const TWO_TENANTS: &str = "[[tenants]]\nname = \"team-a\"\nrights = [\"read\"]\n\n\
                           [[tenants]]\nname = \"team-b\"\nrights = [\"read\", \"write\"]\n";

#[test]
fn resp_tenant_defaults_to_the_first_and_must_exist() {
    let first = ValidConfig::from_toml_str(TWO_TENANTS).expect("config");
    let caller = first.resp_caller();
    assert_eq!(caller.tenant.as_str(), "team-a");
    assert_eq!(caller.rights, Rights::READ_ONLY);

    let picked =
        ValidConfig::from_toml_str(&format!("[listen]\nresp_tenant = \"team-b\"\n\n{TWO_TENANTS}"))
            .expect("config");
    let caller = picked.resp_caller();
    assert_eq!(caller.tenant.as_str(), "team-b");
    assert_eq!(caller.rights, Rights::READ_WRITE);

    let default = ServeConfig::default().validate().expect("the embedded default");
    assert_eq!(default.listen.resp_tenant, None);
    assert_eq!(default.resp_caller().tenant.as_str(), "default");

    let text = format!("[listen]\nresp_tenant = \"team-c\"\n\n{TWO_TENANTS}");
    let Err(e) = ValidConfig::from_toml_str(&text) else {
        panic!("an unknown tenant was accepted")
    };
    assert!(matches!(e, ConfigError::UnknownRespTenant { .. }), "{e:?}");
    assert_eq!(e.key(), Some("listen.resp_tenant"));
    assert_eq!(
        e.to_string(),
        "listen.resp_tenant: team-c is not one of the configured tenants (team-a, team-b)"
    );
    let Err(e) = ValidConfig::from_toml_str("[listen]\nresp_tenant = 3\n") else {
        panic!("a number was accepted as a tenant name")
    };
    assert_eq!(e.key(), Some("listen.resp_tenant"));
}

fn request(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Sends one request and reads a reply of exactly `len` bytes.
fn call(s: &mut TcpStream, args: &[&[u8]], len: usize) -> Vec<u8> {
    s.write_all(&request(args)).expect("send");
    let mut reply = vec![0u8; len];
    s.read_exact(&mut reply).expect("reply");
    reply
}

#[test]
fn serve_answers_redis_clients_as_the_resp_tenant() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("gpucache.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nkind = \"memory\"\n\n[listen]\nnative = \"127.0.0.1:0\"\n\
             resp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\nresp_tenant = \"team-b\"\n\n\
             {TWO_TENANTS}"
        ),
    )
    .expect("write config");
    let running = Serve::start(&config);
    let line = running.line.clone();
    // The fields other tools parse are all there.
    let _native = running.native();
    let _metrics = running.metrics();
    let _epoch = running.epoch();
    assert_eq!(field(&line, "resp_tenant="), "team-b");
    let resp: SocketAddr = field(&line, "resp=").parse().expect("resp addr");

    let mut s = TcpStream::connect_timeout(&resp, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    assert_eq!(call(&mut s, &[b"PING"], 7), b"+PONG\r\n");
    assert_eq!(call(&mut s, &[b"SET", b"k", b"a\r\nb"], 5), b"+OK\r\n");
    assert_eq!(call(&mut s, &[b"GET", b"k"], 10), b"$4\r\na\r\nb\r\n");
    s.write_all(&request(&[b"INFO", b"server"])).expect("send");
    let mut reader = BufReader::new(s.try_clone().expect("clone"));
    let mut header = String::new();
    reader.read_line(&mut header).expect("INFO header");
    let len: usize = header.trim_end().trim_start_matches('$').parse().expect("INFO length");
    let mut info = vec![0u8; len + 2];
    reader.read_exact(&mut info).expect("INFO body");
    let info = String::from_utf8_lossy(&info);
    assert!(info.contains("redis_version:"), "{info}");
    assert!(info.contains("gpucache_tenant:team-b"), "{info}");
    assert!(info.contains("gpucache_store:memory"), "{info}");
    drop(reader);

    running.stop();
    // The open RESP connection was closed by the shutdown.
    let mut byte = [0u8; 1];
    assert!(matches!(s.read(&mut byte), Ok(0) | Err(_)), "a RESP connection outlived serve");
}
