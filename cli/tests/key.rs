//! `gpucache key` decodes real keys and refuses malformed ones with exit code 2.

use std::process::Command;

use gpucache_dataplane::identity::{
    CacheIdentity, Digest32, KvDtype, PositionEncoding, QuantFormat, Shard,
};
use gpucache_dataplane::key::PhysicalKey;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn run(arg: &str) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache")).args(["key", arg]).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn decodes_physical_and_logical_keys() {
    let id = CacheIdentity::builder()
        .tenant("tenant-cli")
        .trust_domain("lab")
        .model_revision("m1")
        .model_config(Digest32([4; 32]))
        .tokenizer_revision("t1")
        .kv_dtype(KvDtype::F8E5m2)
        .quant(QuantFormat::PerChannel)
        .layout("paged", 1)
        .shard(Shard::SOLO)
        .position(PositionEncoding::Alibi)
        .chain(vec![Digest32([8; 32])])
        .block_tokens(64)
        .valid_tokens(64)
        .build()
        .unwrap();
    let k = PhysicalKey::new(id);
    let (code, out, _) = run(&hex(k.encoded()));
    assert_eq!(code, 0);
    assert!(out.starts_with("physical key"), "{out}");
    assert!(out.contains("tenant-cli") && out.contains("F8E5m2"), "{out}");
    let (code, out, _) = run(&hex(k.logical().encoded()));
    assert_eq!(code, 0);
    assert!(out.starts_with("logical key") && !out.contains("F8E5m2"), "{out}");
}

#[test]
fn refuses_malformed_input() {
    let (code, _, err) = run("abc");
    assert_eq!(code, 2);
    assert!(err.contains("odd number of hex digits"), "{err}");
    let (code, _, err) = run(&hex(b"GPCK\x02\x10"));
    assert_eq!(code, 2);
    assert!(err.contains("version 2 is not supported"), "{err}");
}
