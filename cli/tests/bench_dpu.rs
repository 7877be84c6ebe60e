//! `gpucache-bench dpu` end to end on a tiny working set: a smoke check of the harness. It
//! asserts the JSON's structure and that every GET was verified, never a speed.

mod common;

#[test]
fn tiny_run_names_every_path_and_verifies_every_byte() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (code, out, err) = common::gpucache_bench(&[
        "dpu",
        "--sizes",
        "64K,256K",
        "--mib",
        "1",
        "--reactors",
        "2",
        "--no-fio",
        "--dir",
        dir.path().to_str().expect("utf-8"),
    ]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON object");
    assert_eq!(report["bench"], "dpu");
    assert_eq!(report["engine"], "io_uring");
    assert_eq!(report["verified"], true, "{out}");
    let sizes = report["sizes"].as_array().expect("sizes");
    let want: Vec<u64> = vec![64 << 10, 256 << 10];
    assert_eq!(sizes.iter().map(|s| s["size"].as_u64().expect("size")).collect::<Vec<_>>(), want);
    for s in sizes {
        let size = s["size"].as_u64().expect("size");
        let blocks = s["blocks"].as_u64().expect("blocks");
        assert_eq!(blocks, (1u64 << 20).div_ceil(size), "{s}");
        let offload = s["offload"].as_str().expect("offload");
        assert!(offload.starts_with("offload=host-threads reactors=2 "), "{offload}");
        for path in ["dpu-store", "agent-queue", "filestore"] {
            let p = &s["paths"][path];
            assert_eq!(p["verified"], true, "{path} at {size}: {p}");
            assert_eq!(p["verified_bytes"].as_u64(), Some(blocks * size), "{path}: {p}");
            for dir in ["put", "get"] {
                assert_eq!(p[dir]["bytes"].as_u64(), Some(blocks * size), "{path} {dir}");
                for field in ["gbps", "p50_us", "p99_us", "seconds"] {
                    assert!(p[dir][field].is_number(), "{path} {dir} lacks {field}: {p}");
                }
            }
        }
        assert_eq!(s["paths"]["fio"]["skipped"], "skipped (--no-fio)", "{s}");
        for ratio in ["dpu-store/filestore", "dpu-store/fio", "agent-queue/fio"] {
            assert!(s["ratios"][ratio].is_object(), "{ratio} missing: {s}");
        }
        assert!(s["ratios"]["dpu-store/filestore"]["put_gbps"].is_number(), "{s}");
        // Without fio there is nothing to divide by: the ratio says so rather than invent one.
        assert!(s["ratios"]["dpu-store/fio"]["get_gbps"].is_null(), "{s}");
    }
    assert!(err.contains("| 64K | dpu-store |"), "{err}");
    // The scratch directory is removed afterwards.
    assert_eq!(std::fs::read_dir(dir.path()).expect("read dir").count(), 0);
}

#[test]
fn bad_arguments_exit_2() {
    let (code, _, err) = common::gpucache_bench(&["dpu", "--mib", "0", "--no-fio"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--mib"), "{err}");
    let (code, _, err) = common::gpucache_bench(&["dpu", "--reactors", "0", "--no-fio"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--reactors"), "{err}");
}
