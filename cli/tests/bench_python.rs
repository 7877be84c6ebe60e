//! `gpucache-bench python`: argument and setup errors exit 2 with their reason; a tiny run of
//! every row of ours (the Python rows through the venv scripts/setup.sh's `python` component
//! makes) verifies its bytes, counts the same-host items where they should be, and writes JSON
//! with the ratios and aims; a tiny Mooncake batch row does the same. No speed is asserted.
//!
//! Without the Python venv the Python smoke run skips (it fails when
//! `GPUCACHE_REQUIRE_PYTHON=1`, as in CI); likewise the Mooncake one without its venv
//! (`GPUCACHE_REQUIRE_MOONCAKE=1`).

use std::path::{Path, PathBuf};

mod common;

fn bench(args: &[&str]) -> (i32, String, String) {
    common::gpucache_bench(&[&["python"], args].concat())
}

/// `<target>/<profile>/gpucache-bench` -> `<target>/<name>`, as the harness finds its venvs.
fn beside_target(name: &str) -> PathBuf {
    let exe = Path::new(env!("CARGO_BIN_EXE_gpucache-bench"));
    exe.parent().and_then(Path::parent).expect("target dir").join(name)
}

/// The venv at `path` when its Python is there; else `None` (skip), or a failure when
/// `require` is set to 1.
fn venv_or_skip(path: PathBuf, require: &str, setup: &str) -> Option<PathBuf> {
    if path.join("bin").join("python").is_file() {
        return Some(path);
    }
    assert!(
        std::env::var(require).as_deref() != Ok("1"),
        "{require}=1 but {} has no bin/python (run scripts/setup.sh {setup})",
        path.display()
    );
    eprintln!("skipping: no venv at {} (scripts/setup.sh {setup})", path.display());
    None
}

#[test]
fn bad_arguments_and_a_missing_venv_exit_2_with_the_reason() {
    for (args, said) in [
        (&["--rows", "python-udp"][..], "unknown row \"python-udp\""),
        (&["--batches", "16"], "is not ITEMSxSIZE"),
        (&["--batches", "16x1M", "--working-set", "4M"], "smaller than one 16x1M batch"),
        (&["--reps", "0"], "--reps"),
        (&["--rows", "python-tcp", "--py-venv", "/nonexistent/venv"], "scripts/setup.sh python"),
    ] {
        let (code, out, err) = bench(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(said), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: no partial report: {out}");
    }
}

/// The JSON of a tiny run of `rows` at 4 x 64 KiB and 2 x 1 MiB, after checking that it exited 0.
fn tiny_run(rows: &str, venv_args: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("out.json");
    let scratch = dir.path().join("scratch");
    let mut args = vec![
        "--rows",
        rows,
        "--batches",
        "4x64K,2x1M",
        "--reps",
        "2",
        "--seconds",
        "0.2",
        "--working-set",
        "4M",
        "--json",
        json.to_str().expect("utf-8"),
        "--dir",
        scratch.to_str().expect("utf-8"),
    ];
    args.extend_from_slice(venv_args);
    let (code, out, err) = bench(&args);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    for row in rows.split(',') {
        assert!(out.contains(&format!("| 2x1M | {row} |")), "{row} missing:\n{out}");
    }
    // The scratch directory is removed afterwards.
    assert_eq!(std::fs::read_dir(&scratch).expect("read dir").count(), 0);
    serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parses")
}

fn check_samples(doc: &serde_json::Value, rows: &str) {
    let samples = doc["samples"].as_array().expect("samples");
    assert_eq!(samples.len(), rows.split(',').count() * 2 * 2, "rows x shapes x reps");
    for s in samples {
        let row = s["row"].as_str().expect("row");
        let items = s["items"].as_u64().expect("items");
        let size = s["size"].as_u64().expect("size");
        assert!(s["error"].is_null(), "{s}");
        assert_eq!(s["verified"].as_u64(), Some(items), "{s}");
        assert_eq!(s["mismatches"].as_u64(), Some(0), "{s}");
        for op in ["put", "get"] {
            let bytes = s[op]["bytes"].as_u64().expect("bytes");
            assert!(bytes > 0 && bytes % (items * size) == 0, "{op} moved whole batches: {s}");
            assert!(s[op]["p50_us"].is_number(), "{s}");
        }
        // The PUT phase stores at most the 4 MiB pool (each value once).
        assert!(s["put"]["bytes"].as_u64().is_some_and(|b| b <= 4 << 20), "{s}");
        let direct = s["direct_items"].as_u64();
        let bounced = s["bounced_items"].as_u64();
        let layer = s["layer_us"].as_f64();
        if row.starts_with("python-") {
            assert!(layer.is_some_and(|us| us > 0.0), "the binding's cost is measured: {s}");
        } else {
            assert!(layer.is_none(), "{s}");
        }
        if row.ends_with("-local-seg") {
            assert!(direct.is_some_and(|d| d > 0) && bounced == Some(0), "in place: {s}");
        } else if row.ends_with("-local") {
            assert!(bounced.is_some_and(|b| b > 0) && direct == Some(0), "bounced: {s}");
        } else {
            assert!(s["direct_items"].is_null(), "no same-host counters over TCP: {s}");
        }
    }
}

#[test]
fn a_tiny_run_of_every_row_of_ours_verifies_and_pairs_the_rows() {
    let venv = std::env::var_os("GPUCACHE_PY_VENV")
        .map_or_else(|| beside_target("py-venv"), PathBuf::from);
    let Some(venv) = venv_or_skip(venv, "GPUCACHE_REQUIRE_PYTHON", "python") else { return };
    let rows = "rust-tcp,python-tcp,rust-local,python-local,rust-local-seg,python-local-seg";
    let doc = tiny_run(rows, &["--py-venv", venv.to_str().expect("utf-8")]);
    assert_eq!(doc["bench"], "python");
    check_samples(&doc, rows);
    // Three python/rust pairs per shape and operation, each with both repetitions' ratios.
    let ratios = doc["ratios"].as_array().expect("ratios");
    assert_eq!(ratios.len(), 3 * 2 * 2, "{ratios:?}");
    for r in ratios {
        assert_eq!(r["per_rep"].as_array().map(Vec::len), Some(2), "{r}");
        assert!(r["spread"]["median"].as_f64().is_some_and(|m| m > 0.0), "{r}");
    }
    // The aims are judged at 1 MiB only: python/rust for each pair and operation.
    let aims = doc["aims"].as_array().expect("aims");
    assert_eq!(aims.len(), 3 * 2, "{aims:?}");
    assert!(aims.iter().all(|a| a["batch"] == "2x1M" && a["need"] == 0.95), "{aims:?}");
}

#[test]
fn a_tiny_mooncake_batch_row_verifies() {
    let venv = beside_target("bench-venv");
    let Some(venv) = venv_or_skip(venv, "GPUCACHE_REQUIRE_MOONCAKE", "mooncake") else { return };
    let rows = "rust-tcp,mooncake";
    let doc = tiny_run(rows, &["--mooncake-venv", venv.to_str().expect("utf-8")]);
    check_samples(&doc, rows);
    assert!(doc["skipped"].as_array().is_some_and(Vec::is_empty), "{doc}");
}
