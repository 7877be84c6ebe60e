//! The fuzzers' checked-in seeds stay valid, canonical keys: a regression check that runs in
//! every test pass, without cargo-fuzz.

use std::path::Path;

use gpucache_dataplane::key::{LogicalKey, PhysicalKey};

fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds").join(target);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            (path.display().to_string(), std::fs::read(&path).unwrap())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn physical_seeds_decode_canonically() {
    let all = seeds("physical_key");
    assert!(all.len() >= 3, "expected the checked-in physical seeds");
    for (name, bytes) in all {
        let key = PhysicalKey::decode(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(PhysicalKey::new(key.identity().clone()).encoded(), &bytes[..], "{name}");
    }
}

#[test]
fn logical_seeds_decode_canonically() {
    let all = seeds("logical_key");
    assert!(all.len() >= 3, "expected the checked-in logical seeds");
    for (name, bytes) in all {
        let key = LogicalKey::decode(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(LogicalKey::decode(key.encoded()).unwrap(), key, "{name}");
    }
}
