//! The etcd gRPC stubs checked in at `cluster/src/etcd/etcdserverpb.rs` are exactly what
//! `cluster/proto/etcd.proto` generates today, compiled by protox (a protobuf compiler in pure
//! Rust) and turned into Rust by tonic's code generator. Checking them in keeps protoc, and
//! every code generator, out of the build; this test keeps them from drifting from the proto
//! file or from the generator's version in the lock file.
//!
//! `GPUCACHE_REGENERATE_ETCD=1` writes the generated stubs over the checked-in ones instead of
//! failing.

use std::path::Path;

#[test]
fn checked_in_stubs_match_the_proto_file() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let proto_dir = crate_dir.join("proto");
    let checked_in = crate_dir.join("src/etcd/etcdserverpb.rs");

    let descriptors = protox::compile([proto_dir.join("etcd.proto")], [&proto_dir])
        .unwrap_or_else(|e| panic!("proto/etcd.proto does not compile: {e:?}"));
    let out = tempfile::tempdir().expect("a temporary directory");
    tonic_prost_build::configure()
        .build_server(false)
        .build_transport(false)
        .emit_rerun_if_changed(false)
        .out_dir(out.path())
        .compile_fds(descriptors)
        .expect("the stubs generate");
    let generated = std::fs::read_to_string(out.path().join("etcdserverpb.rs"))
        .expect("the generator writes one file per package");

    if std::env::var_os("GPUCACHE_REGENERATE_ETCD").is_some() {
        std::fs::write(&checked_in, &generated).expect("write the stubs");
        return;
    }
    let current = std::fs::read_to_string(&checked_in).unwrap_or_default();
    assert!(
        current == generated,
        "{} is not what proto/etcd.proto generates; run \
         `GPUCACHE_REGENERATE_ETCD=1 cargo test -p gpucache-cluster --test etcd_stubs` \
         and commit the result",
        checked_in.display()
    );
}
