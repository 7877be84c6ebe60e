//! `gpucache-bench nixl`: argument errors and the fail-closed path exit 2 with their reason;
//! with the `nixl` feature and NIXL present, a tiny run checks its bytes on every path and
//! writes JSON naming every path. No speed is asserted.
//!
//! With the feature but without `libnixl_capi.so` the smoke run skips (it fails when
//! `GPUCACHE_REQUIRE_NIXL=1`, as in CI).

use std::process::Command;

mod common;

fn bench(args: &[&str]) -> (i32, String, String) {
    common::gpucache_bench(&[&["nixl"], args].concat())
}

#[test]
fn bad_arguments_exit_2_with_the_reason() {
    let (code, _, err) = bench(&["--paths", "rdma"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("unknown path \"rdma\""), "{err}");
    let (code, _, err) = bench(&["--iterations", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--iterations"), "{err}");
}

#[cfg(not(feature = "nixl"))]
#[test]
fn without_the_feature_it_fails_closed() {
    let (code, out, err) = bench(&["--sizes", "64K", "--iterations", "2"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("NIXL unavailable: built without the nixl feature"), "{err}");
    assert!(out.is_empty(), "no partial report: {out}");
    // The hidden peer role refuses the same way.
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache-bench"))
        .args(["nixl-peer", "--connect", "1", "--slot-bytes", "4096"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("built without the nixl feature"));
}

#[cfg(feature = "nixl")]
#[test]
fn without_the_library_it_fails_closed_with_the_typed_reason() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache-bench"))
        .args(["nixl", "--sizes", "64K", "--iterations", "2"])
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("NIXL unavailable: libnixl_capi.so"), "{err}");
}

#[cfg(feature = "nixl")]
#[test]
fn a_tiny_run_checks_bytes_and_names_every_path_in_json() {
    if !gpucache_nic::nixl::usable_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let scratch = dir.path().to_str().unwrap();
    let (code, out, err) = bench(&[
        "--sizes",
        "64K",
        "--iterations",
        "3",
        "--warmup",
        "1",
        "--dir",
        scratch,
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let paths = doc["paths"].as_array().unwrap();
    let names: Vec<&str> = paths.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "nixl-write",
            "nixl-read",
            "nixl-raw-write",
            "nixl-raw-read",
            "tcp-put",
            "tcp-get",
            "memcpy"
        ]
    );
    for p in paths {
        let point = &p["points"][0];
        assert_eq!(point["size"], 65536, "{p}");
        assert_eq!(point["verified"], true, "bytes not checked on {p}");
        assert_eq!(point["iterations"], 3, "{p}");
        assert!(point["error"].is_null(), "{p}");
    }
    assert_eq!(doc["ratios"][0]["size"], 65536);
    assert!(doc["ratios"][0]["nixl-read/tcp-get"].is_number(), "{}", doc["ratios"]);
    assert!(out.contains("| 64K | nixl-write |"), "{out}");
}
